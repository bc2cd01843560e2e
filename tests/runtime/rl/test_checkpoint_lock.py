"""A checkpoint folder belongs to one run at a time (runtime/rl/checkpoint_lock.py), with real processes:
two started together never both hold it (20 tries), a SIGKILLed holder's lock is taken over naming it,
and `hflow-plan run` on a held folder is one line, exit 2, before torch loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.runtime.rl.checkpoint_lock import LOCK, CheckpointLock
from hybridflow.simulator.errors import HflowError

HOLD = """
import sys, time
from pathlib import Path
from hybridflow.runtime.rl.checkpoint_lock import CheckpointLock
from hybridflow.simulator.errors import HflowError
folder, go, release = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
lock = CheckpointLock(folder)
try:
    lock.acquire()
except HflowError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
print("holding", flush=True)
while not release.exists():  # held until the test has seen what the other process did
    time.sleep(0.01)
lock.release()
"""

# The race's two contenders: each one process for all the rounds (a process start costs more than a round), a
# fresh folder per round; a refusal printed as a JSON string (one line, whatever the message holds).
CONTEND = """
import json, sys, time
from pathlib import Path
from hybridflow.runtime.rl.checkpoint_lock import CheckpointLock
from hybridflow.simulator.errors import HflowError
root, rounds = Path(sys.argv[1]), int(sys.argv[2])
for r in range(rounds):
    go, release = root / f"go{r}", root / f"release{r}"
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.001)
    lock = CheckpointLock(root / f"ck{r}")
    try:
        lock.acquire()
    except HflowError as e:
        print("refused", json.dumps(str(e)), flush=True)
        continue
    print("holding", flush=True)
    while not release.exists():  # held until the test has seen what the other process did
        time.sleep(0.01)
    lock.release()
    print("released", flush=True)
"""
ROUNDS = 20

PLAN = Path(__file__).parents[3] / "examples" / "plans" / "tiny-local.json"


def _start_holder(folder: Path, go: Path, release: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(go), str(release or go.with_name("never"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_ready(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _holder(folder: Path, go: Path, release: Path | None = None) -> subprocess.Popen:
    return _wait_ready(_start_holder(folder, go, release))


def _wait_holding(proc: subprocess.Popen) -> None:
    assert proc.stdout.readline().strip() == "holding", proc.stderr.read()


@pytest.mark.slow
def test_two_runs_started_together_never_both_hold_the_folder(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", CONTEND, str(tmp_path), str(ROUNDS)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for attempt in range(ROUNDS):
            folder, go, release = tmp_path / f"ck{attempt}", tmp_path / f"go{attempt}", tmp_path / f"release{attempt}"
            for p in procs:  # both spin on the start file
                assert p.stdout.readline().strip() == "ready", (attempt, p.communicate())
            go.touch()
            # each either holds the lock (and keeps it until released) or was refused: read both before releasing
            said = [p.stdout.readline().strip().split(" ", 1) for p in procs]
            release.touch()
            assert sorted(s[0] for s in said) == ["holding", "refused"], (attempt, said)
            winner = next(p for p, s in zip(procs, said, strict=True) if s[0] == "holding")
            assert winner.stdout.readline().strip() == "released", attempt
            refusal = json.loads(next(s[1] for s in said if s[0] == "refused"))
            assert "\n" not in refusal and "in use by another run" in refusal, refusal
            assert f"pid {winner.pid} on host {socket.gethostname()}" in refusal
            assert (folder / LOCK).read_text() == ""  # released: emptied, never deleted
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_killed_holder_is_taken_over_naming_it(tmp_path):
    go = tmp_path / "go"
    go.touch()
    proc = _holder(tmp_path / "ck", go)
    _wait_holding(proc)
    with pytest.raises(HflowError, match=f"in use by another run, pid {proc.pid} on host"):
        CheckpointLock(tmp_path / "ck").acquire()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    lock = CheckpointLock(tmp_path / "ck")
    note = lock.acquire()
    assert note is not None and f"left by pid {proc.pid} on host {socket.gethostname()}" in note
    assert json.loads((tmp_path / "ck" / LOCK).read_text())["pid"] == os.getpid()
    again = CheckpointLock(tmp_path / "ck")  # this process holds it: taken again for free, released once each
    assert again.acquire() is None
    again.release()
    assert json.loads((tmp_path / "ck" / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / "ck" / LOCK).read_text() == ""
    with CheckpointLock(tmp_path / "ck") as fresh:  # a released lock is no stale one
        assert fresh.held


def test_at_a_url_a_dead_holder_on_this_host_is_stale_and_a_live_one_is_not(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    url = "memory://hflow-lock-test/ck"
    lock = CheckpointLock(url)
    lock.file.write(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "started": 0}))
    assert f"left by pid {int(dead.stdout)}" in lock.acquire()
    lock.release()
    assert not lock.file.exists()
    lock.file.write(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": 0}))
    with pytest.raises(HflowError, match=f"pid {os.getppid()}.*\\(if that run is gone, delete memory://"):
        CheckpointLock(url).acquire()
    lock.file.remove()


def test_hflow_plan_run_on_a_held_folder_is_one_line_exit_2_at_once(tmp_path):
    go = tmp_path / "go"
    go.touch()
    holder = _holder(tmp_path / "ck", go)
    try:
        _wait_holding(holder)
        start = time.time()
        proc = subprocess.run(["hflow-plan", "run", str(PLAN), "--iterations", "1", "--checkpoint-dir",
                               str(tmp_path / "ck")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        took = time.time() - start
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"in use by another run, pid {holder.pid}" in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and took < 10, took  # before torch and Ray
