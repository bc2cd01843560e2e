"""GRPO end to end with Ulysses sequence parallelism (sp = 2) on a local Ray cluster: the actor and reference
split each sequence over both devices, the run's calls are the simulator's graph of its plan, and its first
iteration (generated before any update) scores and trains as the same plan at sp = 1."""

import json
import math

import pytest
from rl_util import simulated_calls, tiny_plan

from hybridflow.simulator import ParallelConfig, Workload

pytestmark = [pytest.mark.ray, pytest.mark.slow]

W = Workload(prompts=2, samples_per_prompt=4, prompt_len=16, response_len=8, micro_batch_size=2,
             mini_batches=1)  # one optimizer step an iteration: its loss is on the weights both runs share


def _run(sp: int, tmp_path, iterations: int):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    train = {r: ParallelConfig(dp=2, sp=sp) for r in ("actor", "ref")}
    plan = tiny_plan("grpo", [["actor", "ref"]], [2], train=train, generate=ParallelConfig(dp=2), workload=W)
    metrics = tmp_path / f"sp{sp}.jsonl"
    with Trainer(plan, RunConfig(kl={"coef": 0.01, "placement": "loss"}), metrics_path=metrics) as t:
        out = t.run(iterations)
        assert t.df.calls == simulated_calls(plan, t.config.kl_in_reward)
    assert len(metrics.read_text().splitlines()) == iterations
    return out


def test_grpo_with_sp2_runs_and_its_first_iteration_matches_sp1(ray_local, tmp_path):
    split = _run(2, tmp_path, 3)
    assert [m["iteration"] for m in split] == [1, 2, 3]
    assert all(math.isfinite(m["actor/pg_loss"]) and m["actor/skipped_steps"] == 0 for m in split)
    plain = _run(1, tmp_path, 1)[0]
    first = split[0]
    assert first["reward_mean"] == plain["reward_mean"]  # the same rollouts
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "kl"):
        if key in plain:
            assert first[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), (key, json.dumps(first))
