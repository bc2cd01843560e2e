"""A checkpoint folder belongs to one run at a time: `CKPT/run.lock`, held by the driver while it runs.

Two runs writing one folder overwrite each other's `iter_N` and `latest` (issue #38). On a path the lock
is a POSIX record lock (`fcntl.lockf`) on `run.lock`: the kernel (or, on NFS, the server's lock manager)
releases it when the holding process dies however it dies, so a lock whose holder is gone is free and
the next run takes it over, saying whose it was (the file names the holder: host, pid, start time).
The file itself is never deleted (deleting a locked file lets a third run lock a new one beside it);
releasing empties it. At a URL (an object store has no locks) the lock is the object's content: a
holder on this host whose pid is gone is stale and taken over; one elsewhere is not, and the line says
how to remove it (docs/cluster.md: what this does and does not guarantee there).

POSIX record locks belong to a process and closing any descriptor of the file drops them, so a
process takes each folder's lock once (`_HELD`, counted): `hflow-plan run` takes it before torch
loads, and the Trainer it builds takes it again for free.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import dataclass

from hybridflow.runtime.controller.locations import Location
from hybridflow.simulator.errors import HflowError

LOCK = "run.lock"
UNKNOWN = "an unknown run"


@dataclass
class _Held:
    fd: int | None  # the locked descriptor (None at a URL)
    count: int


_HELD: dict[str, _Held] = {}


def _holder_text(token: str) -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                       "token": token}) + "\n"


def describe_holder(text: str) -> str:
    """'pid 123 on host h (since 05:41:02 UTC)' from a lock file's content ('an unknown run' if unreadable)."""
    try:
        h = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h["started"]))
        return f"pid {h['pid']} on host {h['host']} (since {since})"
    except (ValueError, KeyError, TypeError):
        return UNKNOWN


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use(folder: Location, holder: str, how: str) -> HflowError:
    return HflowError(f"--checkpoint-dir {folder} is in use by another run, {holder}: two runs would overwrite each "
                      f"other's checkpoints; wait for it to end, or give this run a folder of its own{how}")


class CheckpointLock:
    """The lock of one checkpoint folder; `acquire()` returns a line to show when it took over a stale one."""

    def __init__(self, folder: str | Location):
        self.folder = Location(folder)
        self.file = self.folder / LOCK
        self.held = False

    def acquire(self) -> str | None:
        if self.held:
            return None
        key = self.folder.url
        if key in _HELD:
            _HELD[key].count += 1
            self.held = True
            return None
        self.folder.makedirs()
        note = self._acquire_path() if self.folder.on_local_disk else self._acquire_url()
        self.held = True
        return note

    def _acquire_path(self) -> str | None:
        fd = os.open(self.file.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = describe_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            for _ in range(100):  # a holder that has just locked writes its name right after: wait for it
                if holder != UNKNOWN:
                    break
                time.sleep(0.01)
                holder = describe_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise _in_use(self.folder, holder, "") from None
            raise HflowError(f"--checkpoint-dir {self.folder}: cannot lock {self.file} ({e.strerror}); the filesystem "
                             "must support POSIX locks (NFS: mount without 'nolock')") from None
        old = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text(os.urandom(8).hex()).encode(), 0)
        os.fsync(fd)
        _HELD[self.folder.url] = _Held(fd, 1)
        return self._took_over(old)

    def _acquire_url(self) -> str | None:
        old = self.file.read_text().strip() if self.file.is_file() else ""
        if old:
            try:
                h = json.loads(old)
                stale = h["host"] == socket.gethostname() and not _pid_alive(int(h["pid"]))
            except (ValueError, KeyError, TypeError):
                stale = False
            if not stale:
                raise _in_use(self.folder, describe_holder(old), f" (if that run is gone, delete {self.file})")
        token = os.urandom(8).hex()
        self.file.write(_holder_text(token))
        if json.loads(self.file.read_text()).get("token") != token:  # another run wrote it in between
            raise _in_use(self.folder, describe_holder(self.file.read_text()), "")
        _HELD[self.folder.url] = _Held(None, 1)
        return self._took_over(old)

    def _took_over(self, old: str) -> str | None:
        if not old:
            return None
        return (f"took over the lock of {self.folder} left by {describe_holder(old)}, which no longer holds it "
                "(it ended without releasing it)")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        held = _HELD.get(self.folder.url)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[self.folder.url]
        if held.fd is None:
            self.file.remove()
            return
        try:  # emptied first: a run that takes the lock next finds no holder to report as stale
            os.ftruncate(held.fd, 0)
            os.fsync(held.fd)
        finally:
            os.close(held.fd)  # drops the lock

    def __enter__(self) -> CheckpointLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
