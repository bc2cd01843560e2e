"""Why a worker process was killed, from evidence: the kernel's out-of-memory record for its pid in this
machine's kernel log (/dev/kmsg, else `dmesg`); Ray's memory monitor says so in the error itself
(calls.py). Without either the cause is stated as what is known: killed by a signal. Ray's own notice of
the death is kept off the console (`fold_ray_notices`): our line says it, once.

The kernel writes, for a process its OOM killer ends (mm/oom_kill.c):

    Out of memory: Killed process 1234 (python) total-vm:…, anon-rss:…
    Memory cgroup out of memory: Killed process 1234 (python) …
    oom-kill:constraint=CONSTRAINT_NONE,…,task=python,pid=1234,uid=0

A worker on another node has its record in that node's log, which the driver cannot read.
"""

from __future__ import annotations

import os
import re
import subprocess

DEATH_NOTICE = "A worker died or was killed while executing a task"


def oom_record(log: str, pid: int) -> str | None:
    """The kernel log's line saying its OOM killer ended `pid` (None: no such line)."""
    pattern = re.compile(rf"(?:Memory cgroup out of memory|Out of memory): Killed process {pid} \([^)]*\)"
                         rf"|oom-kill:\S*\bpid={pid},")
    for line in reversed(log.splitlines()):
        m = pattern.search(line)
        if m:
            return m.group(0).rstrip(",")
    return None


def kernel_log() -> str | None:
    """This machine's kernel log (None: not readable by this process)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        fd = None
    if fd is not None:
        lines = []
        try:
            while True:
                try:
                    record = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError:  # EPIPE: a record was overwritten while reading; go on
                    continue
                if not record:
                    break
                lines.append(record.decode(errors="replace").split(";", 1)[-1].rstrip("\n"))
        finally:
            os.close(fd)
        return "\n".join(lines)
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def signal_cause(pid: int | None, on_this_machine: bool) -> str:
    """How a worker that exited with no error of its own died, in a few words, from the evidence here."""
    if pid is not None and on_this_machine:
        log = kernel_log()
        if log is not None:
            record = oom_record(log, pid)
            if record:
                return f"was killed by the kernel's out-of-memory killer (kernel log: '{record}')"
            return "was killed by a signal (no out-of-memory record for it in the kernel log, none from Ray's memory " \
                   "monitor)"
    where = "its node's" if not on_this_machine else "this machine's"
    return (f"was killed by a signal (none from Ray's memory monitor; {where} kernel log was not readable here: "
            "`dmesg | grep -i 'killed process'` there tells whether it was the kernel's out-of-memory killer)")


def fold_ray_notices() -> None:
    """Keep Ray's '(raylet) A worker died…' notices off the driver's console: our one line for the death
    says it (with the cause from evidence), so a fault is one line. Other Ray output passes through."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "hflow_folding", False):
        return

    def print_to_stdstream(data, ignore_prefix):
        if data.get("pid") == "raylet" and any(DEATH_NOTICE in line for line in data.get("lines", [])):
            return
        original(data, ignore_prefix)

    print_to_stdstream.hflow_folding = True
    ray_worker.print_to_stdstream = print_to_stdstream

