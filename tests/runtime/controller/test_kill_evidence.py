"""The cause of a killed worker stated from evidence (runtime/controller/kill_evidence.py): the kernel's
OOM record for its pid, as mm/oom_kill.c writes it, else "killed by a signal" with what was looked at.
Real processes and a real SIGKILL; the kernel log this machine has (an OOM kill is not provoked here:
the machine is shared)."""

from __future__ import annotations

import signal
import subprocess
import sys

from hybridflow.runtime.controller.kill_evidence import kernel_log, oom_record, signal_cause

LOG = """\
[ 812.000001] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0
[ 812.000200] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task_memcg=/,\
task=python,pid=12345,uid=0
[ 812.000300] Out of memory: Killed process 12345 (python) total-vm:9000000kB, anon-rss:8000000kB, file-rss:0kB
[ 901.000300] Memory cgroup out of memory: Killed process 777 (ray::_WorkerHost) total-vm:100kB, anon-rss:90kB
"""


def test_the_kernels_oom_record_is_found_for_that_pid_only():
    assert oom_record(LOG, 12345) == "Out of memory: Killed process 12345 (python)"
    assert oom_record(LOG, 777) == "Memory cgroup out of memory: Killed process 777 (ray::_WorkerHost)"
    assert oom_record(LOG.replace("Out of memory: Killed process 12345", "x"), 12345) == (
        "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task_memcg=/,"
        "task=python,pid=12345")
    assert oom_record(LOG, 1234) is None and oom_record(LOG, 77) is None and oom_record("", 1) is None


def test_a_process_killed_by_hand_is_said_to_be_killed_by_a_signal():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cause = signal_cause(proc.pid, on_this_machine=True)
    if kernel_log() is None:  # not readable by this user: the line says so
        assert "kernel log was not readable here" in cause
    else:
        assert cause == ("was killed by a signal (no out-of-memory record for it in the kernel log, none from Ray's "
                         "memory monitor)")
    elsewhere = signal_cause(proc.pid, on_this_machine=False)
    assert "its node's kernel log was not readable here" in elsewhere and "dmesg" in elsewhere
