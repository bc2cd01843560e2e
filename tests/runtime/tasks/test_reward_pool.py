"""The user's reward functions in worker processes (runtime/tasks/reward_pool.py), with real processes and
real timers: the same scores as on the driver, a call that sleeps or hangs stopped at the limit (the run
ends naming the sample, or the sample gets the score the user set and is counted), a call stuck where no
signal reaches it bounded by the driver's deadline, and an exception carrying the user file's traceback
(what `--debug` prints). No Ray."""

from __future__ import annotations

import time

import pytest

from hybridflow.runtime.rl.run_config import ScoringConfig
from hybridflow.runtime.tasks.builtin import sort_reward
from hybridflow.runtime.tasks.reward_pool import ScoringPool, UserTraceback
from hybridflow.simulator.errors import HflowError

USER = '''
import signal, time

def score(prompt, response, **row):
    if response == "sleep":
        time.sleep(30)
    if response == "hang":
        while True:
            pass
    if response == "stuck":  # where no timer reaches it: the signal blocked, as C code holding on would be
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(30)
    if response == "raise":
        return {}["no such key"]
    try:
        return float(len(response))
    except Exception:  # a careless catch-all: must not swallow the timeout
        return 0.0
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER)
    return f"{path}:score"


def _pool(ref, **cfg):
    return ScoringPool(ref, f"reward function '{ref}'", ScoringConfig(**cfg))


def test_the_pool_scores_as_the_driver_does(user_file):
    from hybridflow.runtime.tasks.rewards import score_responses

    prompts = [f"{n:04d}" for n in range(23)]
    responses = ["".join(sorted(p)) if i % 3 else p[::-1] for i, p in enumerate(prompts)]
    pool = _pool("hybridflow.runtime.tasks.builtin:sort_reward", workers=2)
    try:
        got = pool.score_responses(prompts, responses)
        assert got.tolist() == score_responses(sort_reward, prompts, responses).tolist()
        assert pool.score_responses(prompts[:1], responses[:1]).tolist() == got[:1].tolist()  # the pool is reused
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["sleep", "hang"])
def test_a_call_past_the_timeout_ends_the_run_naming_the_sample(user_file, kind):
    pool = _pool(user_file, workers=2, timeout_s=0.5)
    start = time.time()
    try:
        with pytest.raises(HflowError) as err:
            pool.score_responses(["p0", "p1", "p2"], ["ok", kind, "fine"])
    finally:
        pool.close()
    took = time.time() - start
    line = str(err.value)
    assert "\n" not in line and "took more than 0.5 s on sample 1 (prompt 'p1')" in line and "--reward-timeout" in line
    assert took < 15, took  # bounded: the sleeping call was stopped, not waited for


def test_a_timed_out_sample_gets_the_users_score_and_is_counted(user_file):
    pool = _pool(user_file, workers=2, timeout_s=0.5, timeout_score=-1.0)
    try:
        got = pool.score_responses([f"p{i}" for i in range(6)], ["a", "sleep", "abc", "hang", "ab", "sleep"])
        assert got.tolist() == [1.0, -1.0, 3.0, -1.0, 2.0, -1.0] and pool.timeouts == 3
        assert pool.score_responses(["p"], ["abcd"]).tolist() == [4.0] and pool.timeouts == 0  # per batch
    finally:
        pool.close()


def test_a_call_no_signal_reaches_is_bounded_by_the_drivers_deadline(user_file, monkeypatch):
    monkeypatch.setattr("hybridflow.runtime.tasks.reward_pool.HANG_SLACK_S", 1.0)
    pool = _pool(user_file, workers=1, timeout_s=0.5, timeout_score=0.0)
    start = time.time()
    try:
        got = pool.score_responses(["p0", "p1"], ["stuck", "ab"])
        # the stuck call's chunk (one sample here) timed out; its worker killed, the chunks after it sent again
        assert got.tolist() == [0.0, 2.0] and pool.timeouts == 1 and time.time() - start < 10
        assert pool.score_responses(["p"], ["abc"]).tolist() == [3.0]
    finally:
        pool.close()


def test_an_exception_names_the_sample_and_carries_the_users_traceback(user_file, tmp_path):
    pool = _pool(user_file, workers=2)
    try:
        with pytest.raises(HflowError) as err:
            pool.score_responses(["p0", "p1"], ["fine", "raise"])
    finally:
        pool.close()
    assert str(err.value).startswith(f"reward function '{user_file}' raised KeyError ('no such key') on sample 1 "
                                     "(prompt 'p1')")
    cause = err.value.user_error
    assert isinstance(cause, UserTraceback)
    assert f'File "{tmp_path / "my_reward.py"}", line 14, in score' in str(cause) and "KeyError" in str(cause)


def test_timeout_score_without_a_timeout_is_refused():
    with pytest.raises(ValueError, match="set timeout_s too"):
        ScoringConfig(timeout_score=0.0)
