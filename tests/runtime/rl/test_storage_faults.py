"""A failed checkpoint save judged by its evidence (runtime/rl/storage_faults.py): the errno anywhere in the
exception chain (as a worker's error wraps it) or its text, else the folder's free space; real folders. The full-disk runs on a real tmpfs are tests/tools/commands/test_run_disk_full.py."""

from __future__ import annotations

import errno
import os

import pytest

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.rl.checkpoint_manifest import write_manifest
from hybridflow.runtime.rl.storage_faults import check_room, checkpoint_bytes, storage_fault
from hybridflow.simulator.errors import EnvironmentFaultError


def test_an_errno_in_the_chain_is_named_with_what_is_kept(tmp_path):
    folder = Location(tmp_path)
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    wrapped = RuntimeError("'actor.save' failed on rank 0")
    wrapped.__cause__ = quota  # as a worker's exception arrives: its cause carries the OS's error
    fault = storage_fault(folder, folder / "iter_000002", wrapped, None, "iter_000001")
    assert isinstance(fault, EnvironmentFaultError) and fault.exit_code == 4
    assert str(fault) == (f"saving a checkpoint in {folder} failed: disk quota exceeded; fix the storage; checkpoint "
                          "iter_000001 is intact (--resume)")
    text_only = RuntimeError("[Errno 30] Read-only file system: '/ck/iter_000003/actor'")  # only the text survived
    assert "read-only filesystem" in str(storage_fault(folder, folder / "iter_000003", text_only, None, None))
    other = RuntimeError("CUDA error: an illegal memory access")
    assert storage_fault(folder, folder / "iter_000004", other, None, None) is None  # plenty free: not storage


def test_room_is_checked_against_the_previous_checkpoints_size(tmp_path):
    ckpt = tmp_path / "iter_000001"
    ckpt.mkdir()
    (ckpt / "shard").write_bytes(b"x" * 3000)
    write_manifest(Location(ckpt))
    need = checkpoint_bytes(Location(ckpt))
    assert need == 3000
    check_room(Location(tmp_path), need, "iter_000001")  # this disk has room for 3 kB
    with pytest.raises(EnvironmentFaultError, match=r"no space left on .* \(need about 1048576 MB per checkpoint"):
        check_room(Location(tmp_path), 1 << 40, "iter_000001")
    assert checkpoint_bytes(Location(tmp_path / "nothing")) is None
