"""GRPO and PPO on the built-in task with megatron-core training the actor (and the critic), chosen by the
plan's `train.backend`: the actor at tp = 2 feeds the 3D-HybridEngine from Megatron's shards, and the
generation weights equal the trained ones after the switch."""

from __future__ import annotations

import math

import pytest
from dist_util import needs_megatron
from rl_util import tiny_plan

from hybridflow.simulator import ParallelConfig, Workload

pytestmark = [pytest.mark.ray, pytest.mark.slow, needs_megatron]

ITERATIONS = 2


def _run(plan, tmp_path):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    with Trainer(plan, RunConfig(), metrics_path=tmp_path / "metrics.jsonl") as t:
        out = t.run(ITERATIONS)
        fingerprints = t.fingerprints()  # resume checks hash Megatron's optimizer states too
    assert [m["iteration"] for m in out] == list(range(1, ITERATIONS + 1))
    for m in out:
        assert math.isfinite(m["actor/pg_loss"])
        assert 0.0 <= m["reward_mean"] <= 1.0
    assert all(len(h) == 64 for hashes in fingerprints.values() for h in hashes)
    return out, fingerprints


def test_grpo_with_a_megatron_actor_at_tp2(ray_local, tmp_path):
    w = Workload(prompts=2, samples_per_prompt=4, prompt_len=16, response_len=8, micro_batch_size=4)
    plan = tiny_plan("grpo", [["actor", "ref"]], [2], workload=w,
                     train={"actor": ParallelConfig(tp=2, backend="megatron"), "ref": ParallelConfig(dp=2)})
    out, _ = _run(plan, tmp_path)
    assert out[-1]["actor/step"] > out[0]["actor/step"]


def test_ppo_with_megatron_actor_and_critic_colocated(ray_local, tmp_path):
    """Actor and critic share the devices and megatron-core's one parallel state per process."""
    meg = ParallelConfig(tp=2, backend="megatron")
    plan = tiny_plan("ppo", [["actor", "ref", "critic"]], [2],
                     train={"actor": meg, "critic": meg, "ref": ParallelConfig(dp=2)})
    out, _ = _run(plan, tmp_path)
    for m in out:  # one optimizer step per iteration (one mini-batch)
        assert m["actor/step"] == m["critic/step"] == m["iteration"] and math.isfinite(m["critic/loss"])

