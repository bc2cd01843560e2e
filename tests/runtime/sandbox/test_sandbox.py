"""The code sandbox (runtime/sandbox/) with real processes, real rlimits, real signals and real
namespaces: a call that hangs, burns CPU, allocates without bound, forks, floods its output or tries the
network is stopped and says why in one line; the scratch directory is gone afterwards; a call after a
stopped one runs normally. Cases that need `unshare` skip where the kernel does not allow it."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest

from hybridflow.runtime.sandbox import SandboxLimits, run_code, run_function
from hybridflow.runtime.sandbox.run import CHILD, namespaces_available

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=2.0, memory_mb=256, output_kb=16)
needs_ns = pytest.mark.skipif(not namespaces_available(), reason="unshare cannot create namespaces here")
needs_seccomp = pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter is written for x86_64")


def test_ok_output_and_error_is_one_line():
    r = run_code("print(sum(range(10)))", FAST)
    assert (r.ok, r.reason, r.output) == (True, "ok", "45\n")
    assert r.seccomp is (platform.machine() == "x86_64")
    r = run_code("print('before')\nraise ValueError('bad input')", FAST)
    assert (r.ok, r.reason) == (False, "exception")
    assert r.observation() == "before\nerror (exception): ValueError: bad input"


def test_hang_is_stopped_at_wall_time_then_the_next_call_runs():
    t = time.perf_counter()
    r = run_code("import time\ntime.sleep(60)", FAST)
    assert r.reason == "timeout" and "2 s of wall time" in r.error
    assert time.perf_counter() - t < 10
    assert run_code("print('next')", FAST).output == "next\n"


@pytest.mark.slow
def test_cpu_burn_is_stopped_by_rlimit_cpu():
    r = run_code("while True:\n    pass", FAST.model_copy(update={"wall_seconds": 60}))
    assert r.reason == "cpu" and "1 s of CPU time" in r.error
    assert r.seconds < 60


def test_unbounded_allocation_hits_the_memory_limit():
    r = run_code("chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))", FAST)
    assert r.reason == "memory" and "MemoryError" in r.error


def test_fork_is_refused_inside_the_process():
    for code in ("import os\nos.fork()", "import subprocess\nsubprocess.run(['true'])",
                 "import os\nos.system('true')", "import multiprocessing"):
        r = run_code(code, FAST)
        assert r.reason == "refused", (code, r)


@needs_ns
def test_forked_children_die_with_the_call(tmp_path):
    """Without the in-process guard (the kernel's layer alone): a child that outlives its parent would
    write a file a second later; the pid namespace takes it down with the call."""
    marker = tmp_path / "survived"
    code = (f"import os, time\nif os.fork() == 0:\n    time.sleep(1.0)\n    open({str(marker)!r}, 'w').write('x')\n"
            "    os._exit(0)\nprint('parent exits')")
    r = run_code(code, FAST, audit_hook=False, seccomp=False)
    assert r.ok and r.isolated
    time.sleep(2.0)
    assert not marker.exists()


def test_network_is_refused_inside_the_process():
    for code in ("import socket\nsocket.socket()", "import socket\nsocket.getaddrinfo('example.com', 80)",
                 "import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=1)"):
        r = run_code(code, FAST)
        assert r.reason == "refused", (code, r)


@needs_seccomp
def test_seccomp_alone_refuses_fork_socket_exec_but_not_threads():
    """Without the audit hook: the kernel's filter, which native code cannot get around."""
    for code in ("import os\nos.fork()", "import socket\nsocket.socket()", "import os\nos.execv('/bin/true', ['true'])",
                 "import subprocess\nsubprocess.run(['true'])"):
        r = run_code(code, FAST, audit_hook=False)
        assert r.reason == "exception" and "Operation not permitted" in r.error, (code, r)
    r = run_code("import ctypes, os\nprint(ctypes.CDLL(None).fork(), os.getpid() > 0)", FAST, audit_hook=False)
    assert r.ok and r.output.split()[0] == "-1"  # fork() returned -1 (EPERM): no child
    r = run_code("import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()",
                 FAST, audit_hook=False)
    assert (r.ok, r.output) == (True, "thread\n")


@needs_ns
def test_network_namespace_has_no_route():
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 80))"
    r = run_code(code, FAST, audit_hook=False, seccomp=False)
    assert r.reason == "exception" and "unreachable" in r.error.lower()


def test_output_flood_is_cut():
    r = run_code("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", FAST)
    assert r.reason == "output" and len(r.output) <= 16 * 1024


def test_scratch_directory_is_the_cwd_and_is_removed():
    r = run_code("import os\nopen('work.txt', 'w').write('x' * 100)\nprint(os.getcwd())", FAST)
    scratch = Path(r.output.strip())
    assert r.ok and scratch.name.startswith("hflow-sandbox-")
    assert not scratch.exists()
    r = run_code("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(60)", FAST)  # also when killed
    assert r.reason == "timeout" and not Path(r.output.strip()).exists()


def test_function_call_returns_its_value(tmp_path):
    tool = tmp_path / "my_tool.py"
    tool.write_text("import os\ndef add(a, b):\n    return {'sum': a + b}\ndef spin():\n    os.fork()\n")
    r = run_function(f"{tool}:add", {"a": 2, "b": 3}, FAST)
    assert (r.ok, r.output) == (True, '{"sum": 5}')
    assert run_function(f"{tool}:spin", {}, FAST).reason == "refused"


def test_no_process_left_behind():
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    run_code("import time\ntime.sleep(60)", FAST)
    time.sleep(0.2)
    after = {p for p in os.listdir("/proc") if p.isdigit()}
    mine = [p for p in after - before if str(CHILD) in _cmdline(p)]  # the sandbox's processes (unshare, python)
    assert mine == []


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
