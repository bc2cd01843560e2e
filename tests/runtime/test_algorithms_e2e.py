"""Every registered algorithm end to end on the built-in task (5 iterations, tiny model, one device; the
ones test_rl_e2e.py runs in other placements, with the same checks, are left to it), and the
simulator's graph of it equal to the calls its loop made at run time: the loop is the one definition
both run, so the two cannot drift."""

import math

import pytest
from rl_util import PLACEMENT_TESTED, simulated_calls, tiny_plan

from hybridflow.simulator import Workload
from hybridflow.simulator.algorithms import algorithm_names, get_algorithm

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ITERATIONS = 5
WORKLOAD = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8,
                    mini_batches=2)


@pytest.mark.parametrize("name", [a for a in algorithm_names() if a not in PLACEMENT_TESTED])
def test_algorithm_runs_and_its_simulated_graph_is_what_ran(ray_local, name):
    from hybridflow.runtime.trainer import Trainer

    algo = get_algorithm(name)
    plan = tiny_plan(name, [["actor", *algo.critics, "ref"]], workload=WORKLOAD)
    with Trainer(plan) as t:
        out = t.run(ITERATIONS)
        calls, resampled = t.df.calls, t.df.resampled_calls
        kl_in_reward = t.config.kl_in_reward
    assert [m["iteration"] for m in out] == list(range(1, ITERATIONS + 1))
    for m in out:
        assert 0.0 <= m["reward_mean"] <= 1.0 and math.isfinite(m["actor/pg_loss"])
        assert m["actor/skipped_steps"] == 0.0
        assert all(math.isfinite(m[f"{c}/loss"]) for c in algo.critics)
    assert out[-1]["actor/step"] > out[0]["actor/step"]  # two optimizer steps per iteration
    assert calls == simulated_calls(plan, kl_in_reward)
    assert set(resampled) <= {("generate", "actor"), ("reward", "reward")}  # dynamic sampling's extra rounds
