"""GRPO with a LoRA actor end to end on Ray (the tiny model, the `sort` task): the reference is the actor's base
(no ref model; its log-probs are the base model's), the reward rises, only the adapters reach generation after
the first switch (the bytes the simulator prices), and what ran is what the simulator's graph prices."""

from __future__ import annotations

import pytest
import torch
from rl_util import simulated_calls, tiny_plan

from hybridflow.simulator import Workload
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_params

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("peft")

LORA = LoraConfig(rank=8)
ITERATIONS = 10


def lora_plan(**kw):
    w = Workload(prompts=32, samples_per_prompt=8, prompt_len=16, response_len=8, micro_batch_size=64)
    plan = tiny_plan("grpo", [["actor"]], [2], workload=w, **kw)
    return plan.model_copy(update={"roles": {"actor": plan.roles["actor"].model_copy(update={"lora": LORA})}})


@pytest.fixture(scope="module")
def grpo_run(ray_local):
    from hybridflow.runtime.controller.batch import Batch
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    plan = lora_plan()
    with Trainer(plan, RunConfig(seed=0, optimizer={"actor": {"lr": 2e-3}})) as t:
        out = t.run(ITERATIONS)
        calls, want_calls = t.df.calls, simulated_calls(plan, t.config.kl_in_reward)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 20, (8, 24), generator=g)
        batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "position_ids": torch.arange(24).expand(8, 24).clone(), "responses": ids[:, 16:]})
        ref = t.groups["actor"].call("actor", "compute_ref_log_prob", batch)["ref_log_probs"]
        actor = t.groups["actor"].call("actor", "compute_log_prob", batch)["old_log_probs"]
        path = t.workers.model_path("actor")
        timeline = t.timeline
    return dict(plan=plan, out=out, calls=calls, want_calls=want_calls, batch=batch, ref=ref, actor=actor, path=path,
                timeline=timeline)


def test_what_ran_is_what_the_simulator_prices(grpo_run):
    assert grpo_run["calls"] == grpo_run["want_calls"]
    assert ("ref_logprob", "actor") in grpo_run["calls"] and "ref" not in grpo_run["plan"].roles


def test_reward_rises(grpo_run):
    rewards = [m["reward_mean"] for m in grpo_run["out"]]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + 0.03, rewards


def test_reference_is_the_base_model(grpo_run):
    from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
    from hybridflow.runtime.workers.common import load_causal_lm

    out = grpo_run["out"]
    assert out[0]["kl"] == 0.0  # the adapters start at B = 0: the policy is its base
    assert out[-1]["kl"] > 0.0  # and moved away from it
    batch = grpo_run["batch"]
    base = FsdpEngine(load_causal_lm(grpo_run["path"])).compute_log_probs(
        batch.select("input_ids", "attention_mask", "position_ids").tensors, score_width=8)["log_probs"][:, -8:]
    torch.testing.assert_close(grpo_run["ref"], base, rtol=0, atol=1e-6)
    assert not torch.allclose(grpo_run["actor"], base, atol=1e-3)  # the trained policy is not the base


def test_weight_sync_moves_the_adapters(grpo_run):
    plan = grpo_run["plan"]
    adapters = adapter_params(plan.roles["actor"].model, LORA) * 4  # fp32 on the CPU
    syncs = sorted((e for e in grpo_run["timeline"].events if e.op == "reshard"), key=lambda e: e.iteration)
    assert [e.iteration for e in syncs] == list(range(1, ITERATIONS + 1))
    assert syncs[0].bytes >= adapters  # the base once (Table 2's share of it: none when t_g = t), then
    assert all(e.bytes == adapters for e in syncs[1:])  # the adapters alone


def test_resume_is_bit_identical_and_exports_merged_and_adapter(ray_local, tmp_path):
    """A LoRA run checkpointed every iteration, resumed from iteration 1, ends where the straight run ended
    (adapters, their Adam states, step: every rank); its exports are the merged model and peft's adapters."""
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    w = Workload(prompts=4, samples_per_prompt=4, prompt_len=16, response_len=8, micro_batch_size=8)
    plan = tiny_plan("grpo", [["actor"]], [2], workload=w)
    plan = plan.model_copy(update={"roles": {"actor": plan.roles["actor"].model_copy(update={"lora": LORA})}})
    cfg = RunConfig(seed=1, optimizer={"actor": {"lr": 2e-3}})
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    with Trainer(plan, cfg, checkpoint_dir=ckpt, export_dir=export) as t:
        straight = t.run(3)
        want = t.fingerprints()
        t.export_hf()
    assert (ckpt / "iter_000003" / "actor" / "adapter" / "adapter_model.safetensors").is_file()
    assert (export / "actor" / "model.safetensors").is_file()
    assert (export / "actor" / "adapter" / "adapter_config.json").is_file()
    (ckpt / "latest").write_text("iter_000001\n")
    with Trainer(plan, cfg, checkpoint_dir=ckpt) as t:
        resumed = t.run(2, resume=True)
        got = t.fingerprints()
    assert got == want
    for a, b in zip(straight[1:], resumed, strict=True):
        assert (a["iteration"], a["reward_mean"], a["actor/pg_loss"]) == (b["iteration"], b["reward_mean"],
                                                                           b["actor/pg_loss"])
