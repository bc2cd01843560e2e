"""Every registered algorithm end to end on the built-in task (5 iterations, tiny model, one device; the
ones test_rl_e2e.py runs in other placements, with the same checks, are left to it), and the
simulator's graph of it equal to the calls its loop made at run time: the loop is the one definition
both run, so the two cannot drift."""

import math

import pytest
import torch
from rl_util import PLACEMENT_TESTED, simulated_calls, tiny_plan

from hybridflow.simulator import Workload
from hybridflow.simulator.algorithms import algorithm_names, get_algorithm

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ITERATIONS = 5
WORKLOAD = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8,
                    mini_batches=2)


@pytest.mark.parametrize("name", [a for a in algorithm_names() if a not in PLACEMENT_TESTED])
def test_algorithm_runs_and_its_simulated_graph_is_what_ran(ray_local, name):
    from hybridflow.runtime.rl.trainer import Trainer

    algo = get_algorithm(name)
    # An exact-match reward: groups whose samples all fail (or all succeed) are common, so a filtering
    # algorithm (DAPO's dynamic sampling) takes extra rounds.
    plan = tiny_plan(name, [["actor", *algo.critics, "ref"]], workload=WORKLOAD,
                     reward_function="rl_util:exact_sort_reward")
    out, resampled = [], []
    with Trainer(plan) as t:
        expected = simulated_calls(plan, t.config.kl_in_reward)
        for _ in range(ITERATIONS):
            out.append(t.step())
            assert t.df.calls == expected  # what ran is what the simulator prices
            resampled += t.df.resampled_calls
    assert [m["iteration"] for m in out] == list(range(1, ITERATIONS + 1))
    for m in out:
        assert 0.0 <= m["reward_mean"] <= 1.0 and math.isfinite(m["actor/pg_loss"])
        assert m["actor/skipped_steps"] == 0.0 and m["tokens"] > 0
        assert all(math.isfinite(m[f"{c}/loss"]) for c in algo.critics)
    assert out[-1]["actor/step"] > out[0]["actor/step"]
    if algo.hooks.keep_groups(torch.zeros(1, 2)) is not None:  # it filters: extra rounds ran, batches stayed full
        assert resampled and set(resampled) <= {("generate", "actor"), ("reward", "reward")}
        assert any(m["sampling/rounds"] > 1 for m in out)
    else:
        assert not resampled
