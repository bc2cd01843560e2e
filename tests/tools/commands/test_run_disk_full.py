"""`hflow-plan run` with its checkpoint folder on a real size-limited filesystem (a tmpfs mounted in a mount
namespace of the run's own, so nothing outside the test sees it; skipped where mounting is not allowed):
a full disk is named as such with exit code 4, the partial checkpoint is removed, and the metrics file
holds no iteration that no checkpoint holds."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

PLAN = Path(__file__).parents[3] / "examples" / "plans" / "tiny-local.json"
pytestmark = pytest.mark.slow


def _can_mount_tmpfs(where: Path) -> bool:
    tool = shutil.which("unshare")
    return bool(tool) and subprocess.run([tool, "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
                                         capture_output=True).returncode == 0


def _run_on_tmpfs(tmp_path: Path, size: str, iterations: int):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    if not _can_mount_tmpfs(ckpt):
        pytest.skip("mounting a tmpfs in a mount namespace needs root or CAP_SYS_ADMIN (unshare -m)")
    run = (f"hflow-plan run {PLAN} --iterations {iterations} --checkpoint-dir {ckpt} --keep-last 20 "
           f"--metrics {tmp_path / 'm.jsonl'} --json")
    # the run, then what the folder holds as the namespace sees it (the tmpfs goes with the namespace)
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {ckpt} && {run}; "
                           f"code=$?; ls {ckpt}; exit $code"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    metrics = tmp_path / "m.jsonl"
    rows = [json.loads(x)["iteration"] for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    listing = proc.stdout.strip().splitlines()  # the run failed: no JSON line, only the folder's names
    return proc, rows, listing


def test_a_first_checkpoint_that_does_not_fit_is_named_removed_and_exit_4(tmp_path):
    proc, rows, listing = _run_on_tmpfs(tmp_path, "8m", 2)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hflow-plan:")]
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert len(ours) == 1 and ours[0].startswith(f"hflow-plan: error: no space left on {tmp_path / 'ck'} (a "
                                                 "checkpoint needs more than"), ours
    assert "MB free)" in ours[0] and "Traceback" not in proc.stderr
    assert "iter_000001" not in listing and "latest" not in listing, listing  # the partial one removed
    assert rows == []  # no line for an iteration no checkpoint holds


def test_a_checkpoint_of_known_size_is_checked_before_the_save(tmp_path):
    proc, rows, listing = _run_on_tmpfs(tmp_path, "60m", 5)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hflow-plan:")]
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert len(ours) == 1 and f"no space left on {tmp_path / 'ck'} (need about " in ours[0], ours
    saved = sorted(x for x in listing if x.startswith("iter_"))
    assert saved and rows == list(range(1, len(saved) + 1)), (saved, rows)  # metrics never ahead of a checkpoint
    assert f"iter_{len(saved) + 1:06d}" not in listing  # checked before the save: nothing written
