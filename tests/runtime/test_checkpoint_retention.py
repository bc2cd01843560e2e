"""Checkpoint retention (runtime/trainer.py prune_checkpoints): the newest `keep_last` complete
checkpoints stay, the one `latest` names always stays, a crashed save older than the newest complete
one goes, nothing else in the folder is touched. Real folders, no Ray (the end-to-end run with
retention is tests/runtime/test_rl_e2e.py's resume test)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hybridflow.runtime.trainer import prune_checkpoints  # noqa: E402


def make(folder, name, complete=True):
    d = folder / name
    d.mkdir(parents=True)
    (d / "actor").mkdir()
    if complete:
        (d / "driver.json").write_text("{}")


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_keeps_the_newest_complete_ones_and_what_latest_names(tmp_path):
    for i in range(1, 6):
        make(tmp_path, f"iter_{i:06d}", complete=i != 2)  # iteration 2's save crashed
    make(tmp_path, "iter_000006", complete=False)  # a save in progress (newer than every complete one)
    (tmp_path / "latest").write_text("iter_000001\n")  # e.g. rewound by hand to resume from there
    (tmp_path / "notes.txt").write_text("mine")
    gone = prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in gone) == ["iter_000002", "iter_000003"]
    assert names(tmp_path) == ["iter_000001", "iter_000004", "iter_000005", "iter_000006", "latest", "notes.txt"]


def test_keep_last_one_leaves_the_latest_complete_checkpoint(tmp_path):
    for i in (1, 2, 3):
        make(tmp_path, f"iter_{i:06d}")
    (tmp_path / "latest").write_text("iter_000003\n")
    prune_checkpoints(tmp_path, keep_last=1)
    assert names(tmp_path) == ["iter_000003", "latest"]
    prune_checkpoints(tmp_path, keep_last=1)  # nothing more to do
    assert names(tmp_path) == ["iter_000003", "latest"]
