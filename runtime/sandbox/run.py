"""One sandboxed call: a fresh process per call, limited by the kernel and guarded from inside.

The parent (this module) makes a scratch directory (the call's working directory, HOME and TMPDIR), a
private directory for the request, the result and the captured stdout / stderr, and starts
`python -I child.py` in a new session; the child's first act is to set RLIMIT_CPU (SIGXCPU, SIGKILL a
second later), RLIMIT_AS (memory), RLIMIT_FSIZE (output and files written), RLIMIT_NOFILE, RLIMIT_NPROC
(the kernel does not enforce it for root) and RLIMIT_CORE 0 on itself. Where `unshare` works here (probed once) the
child runs in new user, network, pid and mount namespaces: no interface but a down loopback, and every
process it forks dies with it (`--kill-child`). The wall-time limit is the parent's: past it the whole
process group is killed with SIGKILL. Both directories are removed afterwards, whatever happened.
Inside the child, before any user code, a seccomp filter makes the kernel refuse socket(), fork(), vfork(),
clone() of a process, clone3() and execve() (x86_64), and an audit hook refuses sockets, fork/spawn/exec,
signals and ctypes from Python with a readable reason (child.py).

A call never raises for what its code did: the result says what stopped it (`reason`) in one line, which
becomes the conversation's observation.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hybridflow.runtime.sandbox.limits import SandboxLimits

CHILD = Path(__file__).with_name("child.py")
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--mount", "--fork", "--kill-child"]
REASONS = ("ok", "exception", "refused", "memory", "cpu", "timeout", "output", "killed")


@dataclass
class SandboxResult:
    ok: bool
    reason: str  # one of REASONS
    output: str  # the call's stdout (code) or return value (function), cut at the output limit
    error: str  # one line: what stopped it
    seconds: float
    isolated: bool  # ran in its own namespaces
    seccomp: bool | None = None  # the kernel filter was on (None: the process never said, e.g. killed)

    def observation(self) -> str:
        """What the conversation sees: the output, or `error (reason): …` with any output before it."""
        if self.ok:
            return self.output
        head = f"{self.output.rstrip()}\n" if self.output.strip() else ""
        return f"{head}error ({self.reason}): {self.error}"


@lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether `unshare` can give a process its own user, network, pid and mount namespaces here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _rlimits(limits: SandboxLimits) -> dict[str, list[int]]:
    """The rlimits the child sets on itself first thing (child.py), before it reads any user code: set
    there rather than between fork and exec, which is not safe while other threads run tools."""
    mem = limits.memory_mb * 2**20
    out = limits.output_kb * 1024 * 4  # files written by the code too; stdout is read back cut at output_kb
    rl = {"RLIMIT_CPU": [limits.cpu_seconds, limits.cpu_seconds + 1], "RLIMIT_AS": [mem, mem],
          "RLIMIT_FSIZE": [out, out], "RLIMIT_NOFILE": [limits.open_files] * 2, "RLIMIT_CORE": [0, 0]}
    if os.geteuid() != 0:  # root is not held to it
        rl["RLIMIT_NPROC"] = [limits.max_processes + 1] * 2
    return rl


def _wait(proc: subprocess.Popen, wall: float) -> tuple[int, float, bool]:
    """(exit code, CPU seconds of the process and the children it reaped, whether the wall time ran out),
    the process group killed either way: nothing of the call outlives it (with namespaces, its pid
    namespace's processes die with their init)."""
    deadline = time.monotonic() + wall
    timed_out, status, usage = False, None, None
    while status is None:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, usage = st, ru
        elif time.monotonic() > deadline:
            timed_out = True
            _kill_group(proc.pid)
            _, status, usage = os.wait4(proc.pid, 0)
        else:
            time.sleep(0.005)
    _kill_group(proc.pid)
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    return code, usage.ru_utime + usage.ru_stime, timed_out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, cap: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", "replace")
    except OSError:
        return ""


def _run(request: dict, limits: SandboxLimits) -> SandboxResult:
    isolated = limits.isolate and namespaces_available()
    scratch = Path(tempfile.mkdtemp(prefix="hflow-sandbox-"))
    private = Path(tempfile.mkdtemp(prefix="hflow-sandbox-io-"))
    cap = limits.output_kb * 1024
    start = time.perf_counter()
    try:
        req, res = private / "request.json", private / "result.json"
        req.write_text(json.dumps({**request, "rlimits": _rlimits(limits)}))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [*(UNSHARE if isolated else []), sys.executable, "-I", str(CHILD), str(req), str(res)]
        with open(private / "stdout", "wb") as out, open(private / "stderr", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            code, cpu, timed_out = _wait(proc, limits.wall_seconds)
        seconds = time.perf_counter() - start
        stdout = _read(private / "stdout", cap)
        result = json.loads(_read(res, 1 << 20) or "null")
        if timed_out:
            return SandboxResult(False, "timeout", stdout, f"stopped after {limits.wall_seconds:g} s of wall time",
                                 seconds, isolated)
        if result is None:  # the child never wrote its result: a signal stopped it
            err = _read(private / "stderr", 4096).strip().splitlines()
            sig = -code if code < 0 else 0
            if cpu >= limits.cpu_seconds - 0.05 or sig == signal.SIGXCPU:  # through unshare: its exit code 1
                return SandboxResult(False, "cpu", stdout, f"stopped after {limits.cpu_seconds} s of CPU time",
                                     seconds, isolated)
            why = f"the process ended with code {code} and no result" + (f": {err[-1]}" if err else "")
            return SandboxResult(False, "killed", stdout, why, seconds, isolated)
        value = result["value"] if "call" in request else stdout
        if len(value) > cap:
            value = value[:cap] + f"\n… (cut at {limits.output_kb} KiB)"
        filtered = result.get("seccomp")
        if result["ok"]:
            return SandboxResult(True, "ok", value, "", seconds, isolated, filtered)
        return SandboxResult(False, result["kind"] or "exception", stdout, result["error"], seconds, isolated,
                             filtered)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def run_code(code: str, limits: SandboxLimits | None = None, *, audit_hook: bool = True,
             seccomp: bool = True) -> SandboxResult:
    """Run Python source in a fresh sandboxed process; its stdout is the output. `audit_hook` / `seccomp`
    False leave out that guard inside the process (to test each layer alone)."""
    return _run({"code": code, "audit_hook": audit_hook, "seccomp": seccomp}, limits or SandboxLimits())


def run_function(target: str, arguments: dict, limits: SandboxLimits | None = None,
                 sys_path: list[str] | None = None) -> SandboxResult:
    """Import `module:function` (or `file.py:function`) in a fresh sandboxed process and call it with
    `arguments`; its return value (str, else JSON) is the output."""
    return _run({"call": target, "arguments": arguments, "sys_path": sys_path or list(sys.path)},
                limits or SandboxLimits())
