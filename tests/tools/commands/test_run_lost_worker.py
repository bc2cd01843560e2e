"""`hflow-plan run` when a process goes, with real signals: a worker killed by hand is one line (ours, not
Ray's as well) stating the cause from evidence, exit 3; a driver killed with SIGKILL takes its local Ray
cluster with it (agents and workers too), within seconds rather than Ray's one to two minutes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

PLAN = Path(__file__).parents[3] / "examples" / "plans" / "tiny-local.json"
pytestmark = pytest.mark.slow


def _descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below `pid`."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(name))
    out, todo = {}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            try:
                out[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_until_first_iteration(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(["hflow-plan", "run", str(PLAN), "--iterations", "20", "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.is_file() and metrics.read_text()):
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    return proc


def test_a_worker_killed_by_hand_is_one_line_naming_a_signal_exit_3(tmp_path):
    proc = _start_until_first_iteration(tmp_path)
    workers = [p for p, cmd in _descendants(proc.pid).items() if cmd.startswith("ray::_WorkerHost")]
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    ours = [line for line in err.splitlines() if line.startswith("hflow-plan:")]
    assert len(ours) == 1 and f"pid {workers[0]})" in ours[0] and "was killed by a signal" in ours[0], ours
    assert "A worker died or was killed" not in out + err  # Ray's own notice folded into ours
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["iteration"] == 1


def test_a_sigkilled_driver_takes_its_ray_processes_with_it(tmp_path):
    proc = _start_until_first_iteration(tmp_path)
    tree = _descendants(proc.pid)
    ray_procs = {p: c for p, c in tree.items() if "ray" in c.lower() and "ray_reaper" not in c}
    assert any("raylet" in c for c in ray_procs.values()) and any("Agent" in c for c in ray_procs.values()), tree
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(p) for p in ray_procs):
        time.sleep(0.5)
    assert not [c for p, c in ray_procs.items() if _alive(p)]
