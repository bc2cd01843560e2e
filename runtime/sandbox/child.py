"""The sandboxed process's own side (run as a script, `python -I child.py REQUEST RESULT`; standard library
only, so it imports nothing of ours).

Before any user code runs it installs a seccomp filter (x86_64: the kernel refuses socket, fork, vfork,
clone of a process, clone3 and execve with EPERM, whoever calls them, native code included; threads
still start) and then an audit hook (PEP 578) that refuses the same from Python with a reason the model
can read: create a socket, fork, spawn or exec a process, send a signal, load ctypes or the raw process
launcher. The kernel's limits (rlimits, namespaces) are set by the parent (run.py); docs/agents.md says
what holds and what does not.

REQUEST (JSON): {"code": "..."} runs the code as a script (its stdout is the result), or
{"call": "module:function" | "file.py:function", "sys_path": [...], "arguments": {...}} imports the
function and calls it with the arguments (its return value, as a string, is the result). RESULT gets
{"ok": bool, "value": str, "error": str, "kind": "exception" | "refused" | "memory" | "output",
"seccomp": whether the filter is on}.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import resource
import sys
import traceback

REFUSED_EVENTS = {
    "socket.__new__": "open a socket (no network)",
    "socket.getaddrinfo": "resolve a host name (no network)",
    "socket.gethostbyname": "resolve a host name (no network)",
    "os.fork": "fork a process",
    "os.forkpty": "fork a process",
    "os.posix_spawn": "spawn a process",
    "os.spawn": "spawn a process",
    "os.exec": "exec a program",
    "os.system": "run a shell command",
    "subprocess.Popen": "start a process",
    "os.kill": "send a signal",
    "os.killpg": "send a signal",
    "ctypes.dlopen": "load a native library",
}
REFUSED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "multiprocessing"}


class Refused(PermissionError):
    pass


class RefusedImport(ImportError):
    pass


def _hook(event: str, args: tuple) -> None:
    if event in REFUSED_EVENTS:
        raise Refused(f"the sandbox refused to {REFUSED_EVENTS[event]} ({event})")
    if event == "import" and args and args[0].split(".")[0] in REFUSED_IMPORTS:
        raise RefusedImport(f"the sandbox refused to import {args[0]}")


def _load(target: str, sys_path: list[str]):
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_sandboxed_tool", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        sys.path[:0] = sys_path
        module = importlib.import_module(where)
    return getattr(module, name)


def _last_line(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    return (lines[-1] if lines else type(e).__name__).strip()


def _kind(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, (Refused, RefusedImport)) or isinstance(e.__context__, (Refused, RefusedImport)):
        return "refused"
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return "output"
    return "exception"


# seccomp-BPF (x86_64): the kernel itself refuses socket(), fork(), vfork(), clone() of a process (threads
# pass: CLONE_THREAD), clone3() (ENOSYS, so libc falls back to clone) and execve() with EPERM, whatever code
# makes the call (Python, C extension, ctypes). Other architectures: not installed (the result says so).
_SECCOMP_X86_64 = {"arch": 0xC000003E, "socket": 41, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
                   "execve": 59, "execveat": 322}


def _install_seccomp() -> bool:
    import ctypes
    import platform
    import struct

    if platform.machine() != "x86_64":
        return False
    n = _SECCOMP_X86_64
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JSET|K, RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, n["arch"]), (ret, 0, 0, allow),  # another ABI: allowed (x32 aside)
            (ld, 0, 0, 0)]
    for name in ("socket", "fork", "vfork", "execve", "execveat"):
        prog += [(jeq, 0, 1, n[name]), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, n["clone3"]), (ret, 0, 0, enosys),
             (jeq, 0, 3, n["clone"]), (ld, 0, 0, 16), (jset, 1, 0, 0x00010000), (ret, 0, 0, eperm),
             (ret, 0, 0, allow)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.addressof(fbuf), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def main(request_file: str, result_file: str) -> int:
    with open(request_file) as f:
        request = json.load(f)
    for name, (soft, hard) in request.get("rlimits", {}).items():  # before anything of the user's runs
        resource.setrlimit(getattr(resource, name), (soft, hard))
    seccomp = _install_seccomp() if request.get("seccomp", True) else False
    if request.get("audit_hook", True):
        sys.addaudithook(_hook)  # before the user's module is imported: its import-time code is guarded too
    result = {"ok": True, "value": "", "error": "", "kind": "", "seccomp": seccomp}
    try:
        if "call" in request:
            fn = _load(request["call"], request.get("sys_path", []))
            out = fn(**request.get("arguments", {}))
            result["value"] = out if isinstance(out, str) else json.dumps(out, default=str)
        else:
            code = compile(request["code"], "<tool code>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except BaseException as e:  # the tool's own error is its observation
        result.update(ok=False, kind=_kind(e), error=_last_line(e))
    try:
        sys.stdout.flush()
    except OSError:  # stdout past the output limit
        result.update(ok=False, kind="output", error="wrote past the output limit (File too large)")
    with open(result_file, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
