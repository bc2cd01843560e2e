"""`hflow-plan run` with a user's reward function in worker processes (--reward-workers, --reward-timeout):
calls that hang are stopped at the limit and scored as the user said, counted in the metrics, the run
ends; an exception in the user's file is one line, and `--debug` prints its traceback from that file.
Real processes: the command, the pool's workers, and the session's Ray cluster, which the command joins
(`--address`: these tests are not about Ray's own start)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

PLAN = Path(__file__).parents[3] / "examples" / "plans" / "tiny-local.json"
pytestmark = pytest.mark.slow

USER = '''
import time

from hybridflow.runtime.tasks.builtin import sort_reward


def score(prompt, response, **row):
    if response and response[-1] in "13579":  # some responses hang
        time.sleep(600)
    return sort_reward(prompt, response, **row)


def broken(prompt, response, **row):
    if response:  # an empty response (the up-front check's) scores; a real one fails deep in the file
        return helper(response)
    return 0.0


def helper(response):
    return int(response) / 0
'''


def _run(tmp_path, address, *extra):
    (tmp_path / "my_reward.py").write_text(USER)
    return subprocess.run(["hflow-plan", "run", str(PLAN), "--iterations", "2", "--reward-workers", "2",
                           "--metrics", "m.jsonl", "--json", "--address", address, *extra], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


def test_hanging_calls_are_stopped_scored_and_counted(tmp_path, ray_address):
    proc = _run(tmp_path, ray_address, "--reward-function", "my_reward.py:score", "--reward-timeout", "0.5",
                "--reward-timeout-score", "-1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["reward/timeouts"] >= 1 for r in rows), [r["reward/timeouts"] for r in rows]
    # two workers, 0.5 s per stopped call: the iteration's reward op is bounded by the count, not by the sleep
    assert all(r["op_seconds"]["reward"] < r["reward/timeouts"] * 0.5 / 2 + 5 for r in rows), rows


def test_debug_shows_the_users_traceback_then_one_line(tmp_path, ray_address):
    proc = _run(tmp_path, ray_address, "--reward-function", "my_reward.py:broken", "--debug")
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("hflow-plan:")]
    assert len(ours) == 1 and ours[0].startswith("hflow-plan: error: reward function 'my_reward.py:broken' raised "
                                                 "ZeroDivisionError (division by zero) on sample"), ours
    tb = proc.stderr[:proc.stderr.index(ours[0])]
    assert f'File "{tmp_path / "my_reward.py"}", line 20, in helper' in tb and "reward_worker.py" not in tb, tb
    # without --debug the line alone: tests/runtime/rl/test_user_model_e2e.py
