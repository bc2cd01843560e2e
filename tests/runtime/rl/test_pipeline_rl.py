"""End to end on the local Ray cluster: GRPO with the actor trained in 2 pipeline stages (generation
whole on each device after the 3D-HybridEngine switch) and a PPO critic in 2 stages."""

import math

import pytest
from rl_util import tiny_plan

from hybridflow.simulator import ParallelConfig, Workload

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(plan, tmp_path):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    with Trainer(plan, RunConfig(), metrics_path=tmp_path / "metrics.jsonl") as t:
        return t.run(2), t.timeline


def test_ppo_actor_and_critic_in_two_pipeline_stages(ray_local, tmp_path):
    w = Workload(prompts=4, samples_per_prompt=1, prompt_len=16, response_len=8, micro_batch_size=2, mini_batches=1)
    pp2 = ParallelConfig(pp=2)
    plan = tiny_plan("ppo", [["actor", "ref", "critic"]], [2], workload=w,
                     train={"actor": pp2, "ref": ParallelConfig(dp=2), "critic": pp2},
                     generate=ParallelConfig(tp=1, dp=2))
    out, timeline = _run(plan, tmp_path)
    assert [m["iteration"] for m in out] == [1, 2]
    for m in out:
        assert m["actor/step"] == m["iteration"] and m["critic/step"] == m["iteration"]
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["critic/loss"])
        assert 0.0 <= m["reward_mean"] <= 1.0
    reshard = [e for e in timeline.events if e.op == "reshard"]
    assert len(reshard) == 2 and all(e.bytes > 0 for e in reshard)  # p=2 → t_g=1: (2−1)/2·M per device
