"""A resume verifies checkpoints against their manifests (runtime/rl/checkpoint_manifest.py) and falls back
to the newest whole one, naming those it skipped: the damage issue #38 found (a `latest` naming a deleted
folder, an empty `latest`, a truncated driver.json, truncated or altered shards), on real files. The
run with Ray that resumes bit-exactly past a damaged checkpoint is in test_rl_e2e.py; `hflow-plan run
--resume` on a folder with nothing whole is one line, exit 2, before torch (below)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.rl.checkpoint_manifest import MANIFEST, check_checkpoint, resume_point, write_manifest

PLAN = Path(__file__).parents[3] / "examples" / "plans" / "tiny-local.json"


def _checkpoint(folder: Path, i: int) -> Location:
    ckpt = folder / f"iter_{i:06d}"
    (ckpt / "actor" / "dcp").mkdir(parents=True)
    (ckpt / "actor" / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * (40 + i))
    (ckpt / "actor" / "extra_rank0.pt").write_bytes(b"rng" * i)
    (ckpt / "driver.json").write_text(f'{{"iteration": {i}}}\n')
    write_manifest(Location(ckpt))
    (folder / "latest").write_text(f"iter_{i:06d}\n")
    return Location(ckpt)


@pytest.fixture
def three(tmp_path):
    for i in (1, 2, 3):
        _checkpoint(tmp_path, i)
    return tmp_path


def test_whole_checkpoints_verify_and_latest_is_taken(three):
    point = resume_point(Location(three), "iter_000003")
    assert point.checkpoint.name == "iter_000003" and point.skipped == []


@pytest.mark.parametrize("damage, why", [
    (lambda d: (d / "iter_000003" / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"x" * 100),
     "actor/dcp/__0_0.distcp is 100 bytes, the manifest says 11008"),
    (lambda d: (d / "iter_000003" / "driver.json").write_text('{"iterat'), "driver.json is 8 bytes"),
    (lambda d: (d / "iter_000003" / "actor" / "extra_rank0.pt").write_bytes(b"RNGRNGRNG"),
     "actor/extra_rank0.pt does not match its checksum"),
    (lambda d: (d / "iter_000003" / "actor" / "extra_rank0.pt").unlink(), "actor/extra_rank0.pt is missing"),
    (lambda d: (d / "iter_000003" / MANIFEST).write_text("{"), "manifest.json is damaged"),
    (lambda d: (d / "iter_000003" / MANIFEST).unlink(), "no manifest.json"),
])
def test_a_damaged_latest_falls_back_to_the_previous_whole_one(three, damage, why):
    damage(three)
    point = resume_point(Location(three), "iter_000003")
    assert point.checkpoint.name == "iter_000002"
    assert len(point.skipped) == 1 and point.skipped[0][0] == "iter_000003" and why in point.skipped[0][1]
    assert point.skipped_lines() == [f"skipped checkpoint iter_000003: {point.skipped[0][1]}"]


def test_latest_naming_a_deleted_folder_or_nothing(three):
    import shutil

    shutil.rmtree(three / "iter_000003")
    point = resume_point(Location(three), "iter_000003")
    assert point.checkpoint.name == "iter_000002"
    assert point.skipped == [("iter_000003", "named by 'latest', the folder is not there")]
    point = resume_point(Location(three), "")  # an empty `latest`: every checkpoint is a candidate
    assert point.checkpoint.name == "iter_000002" and point.skipped[0][0] == "latest"
    assert resume_point(Location(three), None).checkpoint.name == "iter_000002"  # no `latest` at all


def test_latest_rewound_by_hand_is_honoured(three):
    assert resume_point(Location(three), "iter_000001").checkpoint.name == "iter_000001"


def test_nothing_whole_is_one_line_naming_each(three):
    for i in (1, 2, 3):
        (three / f"iter_{i:06d}" / "driver.json").write_text("{}")
    point = resume_point(Location(three), "iter_000003")
    assert point.checkpoint is None and [n for n, _ in point.skipped] == ["iter_000003", "iter_000002", "iter_000001"]
    line = point.none_line(Location(three))
    assert "\n" not in line and line.startswith(f"nothing to resume in {three}: no complete checkpoint (iter_000003: ")


def test_a_verified_answer_is_kept_but_a_new_manifest_is_checked_again(three):
    ckpt = Location(three / "iter_000002")
    assert check_checkpoint(ckpt) is None
    (three / "iter_000002" / "driver.json").write_text('{"iteration": 9}\n')  # same size, other bytes
    write_manifest(ckpt)
    assert check_checkpoint(ckpt) is None


def test_hflow_plan_run_resume_with_nothing_whole_is_one_line_exit_2_before_torch(three):
    for i in (1, 2, 3):
        (three / f"iter_{i:06d}" / "actor" / "dcp" / "__0_0.distcp").write_bytes(b"")
    start = time.time()
    proc = subprocess.run(["hflow-plan", "run", str(PLAN), "--resume", "--checkpoint-dir", str(three)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.time() - start < 10, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing to resume" in lines[0] and "iter_000001: actor/dcp/__0_0.distcp is 0 bytes" \
        in lines[0], proc.stderr
