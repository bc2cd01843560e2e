"""Storage faults of a checkpoint save named as what they are: no space left (with what a checkpoint needs
and what is free), a read-only folder, an I/O error, a quota. `EnvironmentFaultError`, exit code 4.

Torch's writers do not always say why a write failed (a full disk can come back from a worker as
`inline_container.cc: unexpected pos 704 vs 598`), so a failed save is judged by its evidence: the
errno in the exception chain, else the folder's free space right after the failure (before the
partial checkpoint is removed). Where the size of a checkpoint is known (the previous one's manifest)
and the folder is on a local or mounted filesystem, the room is checked before the save starts.
"""

from __future__ import annotations

import errno
import json
import shutil

from hybridflow.runtime.controller.locations import Location
from hybridflow.simulator.errors import EnvironmentFaultError

MB = 1 << 20
FULL_BELOW = 1 * MB  # free space under this after a failed save: the disk filled up
CODES = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only filesystem",
         errno.EIO: "I/O error"}
MESSAGES = {"no space left on device": errno.ENOSPC, "disk quota exceeded": errno.EDQUOT,
            "read-only file system": errno.EROFS, "input/output error": errno.EIO}


def free_bytes(folder: Location) -> int | None:
    """Free bytes where `folder` is (None at a URL: an object store has no such figure)."""
    if not folder.on_local_disk:
        return None
    try:
        return shutil.disk_usage(folder.path).free
    except OSError:
        return None


def checkpoint_bytes(ckpt: Location) -> int | None:
    """A checkpoint's size from its manifest (None without one)."""
    try:
        return sum(f["size"] for f in json.loads((ckpt / "manifest.json").read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _kept(previous: str | None) -> str:
    return f"checkpoint {previous} is intact (--resume)" if previous else "no checkpoint was complete yet"


def _no_space(folder: Location, need: int | None, free: int, previous: str | None,
              written: int | None = None) -> EnvironmentFaultError:
    if need:
        size = f"need about {need / MB:.0f} MB per checkpoint"
    else:
        size = f"a checkpoint needs more than the {written / MB:.0f} MB written before it failed" if written else \
            "a checkpoint did not fit"
    return EnvironmentFaultError(f"no space left on {folder} ({size}, {free / MB:.0f} MB free): free some space, "
                                 f"lower --keep-last, or give a --checkpoint-dir on a larger disk; {_kept(previous)}")


def check_room(folder: Location, need: int | None, previous: str | None) -> None:
    """Before a save: one line, exit 4, when a checkpoint of `need` bytes cannot fit."""
    free = free_bytes(folder)
    if need and free is not None and free < need:
        raise _no_space(folder, need, free, previous)


def _errno_in(exc: BaseException) -> int | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in CODES:
            return exc.errno
        text = str(exc).lower()
        for message, code in MESSAGES.items():
            if message in text:
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def storage_fault(folder: Location, partial: Location, exc: BaseException, need: int | None,
                  previous: str | None) -> EnvironmentFaultError | None:
    """The one line for a save that failed because of the storage (None: it failed for another reason)."""
    code = _errno_in(exc)
    free = free_bytes(folder)
    if code == errno.ENOSPC or (code is None and free is not None and free < FULL_BELOW):
        written = None
        if partial.on_local_disk and partial.exists():
            written = sum(f["size"] for f in partial.fs.find(partial.path, detail=True).values())
        return _no_space(folder, need, free or 0, previous, written)
    if code is not None:
        return EnvironmentFaultError(f"saving a checkpoint in {folder} failed: {CODES[code]}; fix the storage; "
                                     f"{_kept(previous)}")
    return None
