"""Checkpoint retention (runtime/rl/checkpoints.py prune_checkpoints): the newest `keep_last` complete
checkpoints stay, the one `latest` names always stays, a crashed save older than the newest complete
one goes, nothing else in the folder is touched. Alike in a local folder and at a URL (fsspec's
memory://: no file of it is on disk, so no step can take a path for it). No Ray (the end-to-end run
with retention is tests/runtime/rl/test_rl_e2e.py's resume test)."""

from __future__ import annotations

import secrets

import pytest

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.rl.checkpoint_manifest import write_manifest
from hybridflow.runtime.rl.checkpoints import prune_checkpoints


@pytest.fixture(params=["path", "url"])
def folder(request, tmp_path):
    where = Location(tmp_path if request.param == "path" else f"memory://retention-{secrets.token_hex(4)}")
    yield where
    where.remove()


def make(folder, name, complete=True):
    (folder / name / "actor" / "shard").write("x")
    if complete:
        (folder / name / "driver.json").write("{}")
        write_manifest(folder / name)


def names(folder):
    return [p.name for p in folder.children()]


def test_keeps_the_newest_complete_ones_and_what_latest_names(folder):
    for i in range(1, 6):
        make(folder, f"iter_{i:06d}", complete=i != 2)  # iteration 2's save crashed
    make(folder, "iter_000006", complete=False)  # a save in progress (newer than every complete one)
    (folder / "latest").write("iter_000001\n")  # e.g. rewound by hand to resume from there
    (folder / "notes.txt").write("mine")
    gone = prune_checkpoints(folder, keep_last=2)
    assert sorted(p.name for p in gone) == ["iter_000002", "iter_000003"]
    assert names(folder) == ["iter_000001", "iter_000004", "iter_000005", "iter_000006", "latest", "notes.txt"]


def test_keep_last_one_leaves_the_latest_complete_checkpoint(folder):
    for i in (1, 2, 3):
        make(folder, f"iter_{i:06d}")
    (folder / "latest").write("iter_000003\n")
    prune_checkpoints(folder, keep_last=1)
    assert names(folder) == ["iter_000003", "latest"]
    prune_checkpoints(folder, keep_last=1)  # nothing more to do
    assert names(folder) == ["iter_000003", "latest"]
