"""HF <-> megatron-core weights (engines/megatron_weights.py): exact round trips for every family the
megatron backend runs, fused QKV per query group, fc1 = [gate; up], tensor-parallel shards that
rebuild the whole. Pure tensor code: no megatron import, runs without megatron-core installed."""

from __future__ import annotations

import pytest
import torch
from engine_util import tiny_model

from hybridflow.runtime.engines.train.megatron.model import megatron_problems
from hybridflow.runtime.engines.train.megatron.weights import (
    hf_to_megatron,
    hf_tp_dim,
    is_expert,
    megatron_to_hf,
    partition,
    to_local_expert,
    tp_shard,
    tp_unshard,
)
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig, RopeScaling

OPTIONS = {
    "llama-gqa": dict(num_key_value_heads=2),
    "qwen2-tied": dict(num_key_value_heads=2, qkv_bias=True, tie_word_embeddings=True),
    "qwen3-qknorm": dict(num_key_value_heads=1, qk_norm=True, head_dim=32),
    "all-biases": dict(qkv_bias=True, o_bias=True, mlp_bias=True),
    "mixtral-moe": dict(family="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}


def _state(options: dict, score: bool = False) -> dict[str, torch.Tensor]:
    model = tiny_model(score=score, **options)
    with torch.no_grad():  # norms and biases off their initial 1 / 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.config, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("score", [False, True])
def test_round_trip_is_exact(case, score):
    cfg, hf = _state(OPTIONS[case], score)
    mg = hf_to_megatron(hf, cfg)
    back = megatron_to_hf(mg, cfg, "scalar" if score else "lm")
    if cfg.tie_word_embeddings and not score:
        assert "output_layer.weight" not in mg
        hf = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_qkv_is_grouped_per_query_group():
    cfg, hf = _state(OPTIONS["llama-gqa"])
    qkv = hf_to_megatron(hf, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per_group = cfg.dim_head, cfg.num_attention_heads // cfg.num_key_value_heads
    p = "model.layers.0.self_attn."
    group1 = qkv[(per_group + 2) * d:]  # the second query group: its 2 query heads, its k head, its v head
    assert torch.equal(group1[:per_group * d], hf[p + "q_proj.weight"][per_group * d:])
    assert torch.equal(group1[per_group * d:(per_group + 1) * d], hf[p + "k_proj.weight"][d:])
    assert torch.equal(group1[(per_group + 1) * d:], hf[p + "v_proj.weight"][d:])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_rebuild_the_whole_and_hold_whole_groups(tp):
    cfg, hf = _state(dict(num_key_value_heads=4, qkv_bias=True))
    mg = hf_to_megatron(hf, cfg)
    for name, full in mg.items():
        shards = [tp_shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(tp_unshard(name, shards), full), name
        dim, _ = partition(name)
        if dim is not None:
            assert shards[0].shape[dim] == full.shape[dim] // tp, name
    fc1 = tp_shard("decoder.layers.0.mlp.linear_fc1.weight", mg["decoder.layers.0.mlp.linear_fc1.weight"], 1, tp)
    f = cfg.intermediate_size // tp  # rank 1 holds [its gate shard; its up shard]
    assert torch.equal(fc1[:f], hf["model.layers.0.mlp.gate_proj.weight"][f:2 * f])
    assert torch.equal(fc1[f:], hf["model.layers.0.mlp.up_proj.weight"][f:2 * f])
    assert partition("decoder.layers.0.self_attention.linear_proj.weight") == (1, 1)
    assert partition("decoder.layers.0.self_attention.linear_proj.bias") == (None, 1)


def test_experts_map_to_megatrons_local_experts_whole_over_tp():
    cfg, hf = _state(OPTIONS["mixtral-moe"])
    mg = hf_to_megatron(hf, cfg)
    x, hx = "decoder.layers.1.mlp.", "model.layers.1.block_sparse_moe."
    assert torch.equal(mg[x + "router.weight"], hf[hx + "gate.weight"])
    fc1 = mg[x + "experts.local_experts.3.linear_fc1.weight"]  # [gate; up] of expert 3
    assert torch.equal(fc1, torch.cat([hf[hx + "experts.3.w1.weight"], hf[hx + "experts.3.w3.weight"]]))
    assert torch.equal(mg[x + "experts.local_experts.3.linear_fc2.weight"], hf[hx + "experts.3.w2.weight"])
    for name in (x + "router.weight", x + "experts.local_experts.3.linear_fc1.weight"):
        assert partition(name) == (None, 1) and torch.equal(tp_shard(name, mg[name], 1, 2), mg[name])
    assert hf_tp_dim(hx + "experts.3.w1.weight") is None and hf_tp_dim(hx + "gate.weight") is None
    # ep rank 1 of 2 holds experts 2 and 3 as its local 0 and 1
    assert to_local_expert(x + "experts.local_experts.3.linear_fc2.weight", 2) == x + "experts.local_experts.1.linear_fc2.weight"
    assert is_expert(x + "experts.local_experts.0.linear_fc1.weight") and not is_expert(x + "router.weight")
    assert "ep=3 must divide the experts per layer (4)" in megatron_problems(cfg, ep=3)[0]


def test_what_megatron_cannot_run_is_named():
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    assert megatron_problems(DecoderConfig(**base), tp=2, pp=2) == []
    assert "RoPE scaling" in megatron_problems(DecoderConfig(**base, rope_scaling=RopeScaling(rope_type="linear",
                                                                                              factor=2.0)))[0]
    assert "sliding" in megatron_problems(DecoderConfig(**base, sliding_window=8))[0]
    assert "o_proj" in megatron_problems(DecoderConfig(**base, o_bias=True))[0]
    assert "kv heads" in megatron_problems(DecoderConfig(**base), tp=4)[0]
    assert "layers" in megatron_problems(DecoderConfig(**base), pp=4)[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_megatron_shards_are_the_hf_tp_shards(tp):
    """What the 3D-HybridEngine receives from a megatron rank: HF names, split along hf_tp_dim."""
    cfg, hf = _state(dict(num_key_value_heads=4, qkv_bias=True))
    mg = hf_to_megatron(hf, cfg)
    for r in range(tp):
        local = megatron_to_hf({k: tp_shard(k, v, r, tp) for k, v in mg.items()}, cfg, tp=tp)
        assert local.keys() == hf.keys()
        for name, whole in hf.items():
            dim = hf_tp_dim(name)
            expect = whole if dim is None else whole.chunk(tp, dim)[r]
            assert torch.equal(local[name], expect), name
        back = hf_to_megatron(local, cfg, tp=tp)
        assert all(torch.equal(back[k], tp_shard(k, v, r, tp)) for k, v in mg.items())
