"""Files a run publishes: each metrics line once per iteration across resumes, and outputs fsynced
(file and folder) before and after the rename that publishes them. No Ray, no torch."""

from __future__ import annotations

import json
import os

from hybridflow.runtime.rl.metrics_file import append_metrics, drop_after
from hybridflow.simulator.io import write_atomic


def test_a_resume_drops_the_lines_of_iterations_after_its_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"note": "an earlier tool\'s line"}\n')
    for i in (1, 2, 3, 4):
        append_metrics(path, {"iteration": i, "reward_mean": i / 10})
    with open(path, "a") as f:
        f.write('{"iteration": 5, "rew')  # a process killed inside its write
    assert drop_after(path, 2) == 3
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [{"note": "an earlier tool's line"}, {"iteration": 1, "reward_mean": 0.1},
                    {"iteration": 2, "reward_mean": 0.2}]
    append_metrics(path, {"iteration": 3, "reward_mean": 0.33})
    assert [json.loads(x).get("iteration") for x in path.read_text().splitlines()] == [None, 1, 2, 3]
    before = path.stat().st_mtime_ns
    assert drop_after(path, 3) == 0 and path.stat().st_mtime_ns == before  # nothing to drop: untouched
    assert drop_after(tmp_path / "none.jsonl", 0) == 0 and drop_after(None, 0) == 0


def test_write_atomic_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = write_atomic(tmp_path / "latest", "iter_000002\n")
    assert target.read_text() == "iter_000002\n"
    kinds = [k for k, _ in calls]
    assert kinds == ["fsync", "replace", "fsync"], calls
    assert calls[0][1].startswith(str(tmp_path / ".latest.")) and calls[2][1] == str(tmp_path)
