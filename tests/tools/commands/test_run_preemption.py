"""`hflow-plan run` stopped by SIGTERM, as a job scheduler sends it: one line of ours (no Ray signal dump,
no traceback), exit 143, a checkpoint of the last finished iteration and its metrics lines. Real processes:
the command, its workers, and the session's Ray cluster, which the command joins (`--address`). That `--resume` then continues to the same metrics as a
run never stopped is checked in process, at every moment a SIGTERM can come (tests/runtime/rl/test_run_faults.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

PLAN = Path(__file__).parents[3] / "examples" / "plans" / "tiny-local.json"
pytestmark = pytest.mark.slow


def _run(tmp_path, name, address, *extra, sigterm_after_lines=None):
    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.Popen(["hflow-plan", "run", str(PLAN), "--iterations", "3", "--metrics", str(metrics),
                             "--checkpoint-dir", str(tmp_path / f"{name}-ck"), "--json", "--address", address, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    if sigterm_after_lines:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= sigterm_after_lines:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err, metrics


def _rewards(metrics: Path) -> list[tuple[int, float]]:
    return [(r["iteration"], r["reward_mean"]) for r in map(json.loads, metrics.read_text().splitlines())]


def test_sigterm_saves_says_one_line_and_exits_143(tmp_path, ray_address):
    rc, _, err, stopped = _run(tmp_path, "stopped", ray_address, sigterm_after_lines=1)
    ours = [line for line in err.splitlines() if line.startswith("hflow-plan:")]
    assert rc == 143, err
    assert len(ours) == 1 and ours[0].startswith("hflow-plan: stopped: preempted (SIGTERM): stopped after iteration")
    assert "continue with --resume" in ours[0]
    assert "Traceback" not in err and "SIGTERM handler" not in err and "received signal" not in err.lower(), err
    done = int((tmp_path / "stopped-ck" / "latest").read_text().strip()[5:])
    assert 1 <= done < 3 and [i for i, _ in _rewards(stopped)] == list(range(1, done + 1))
    assert (tmp_path / "stopped-ck" / f"iter_{done:06d}" / "manifest.json").is_file()  # complete: resumable
