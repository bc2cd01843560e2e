"""A `CausalLM`'s weights as fast_decode.py's fused operands, before any kernel's layout: per layer
q|k|v and gate|up as `RowBlocks` (matmul_kernels.py: not concatenated until a kernel needs it),
with each RMSNorm's weight and sqrt(hidden) folded in as their columns' scale, attention's
1/sqrt(head_dim) in q's rows (in q_norm's weight where the family normalises each q and k head:
Qwen3), and q's and k's rows in RoPE's paired order."""

from __future__ import annotations

import torch

from hybridflow.runtime.engines.cpu_decode.matmul_kernels import RowBlocks
from hybridflow.runtime.models.decoder import CausalLM

GATE_UP = 4  # the gate|up weight's index in a layer's operands (q|k|v, its bias, o, its bias, gate|up, …)


def _paired_order(rows: int, head_dim: int) -> torch.Tensor:
    """The rows of a q/k projection [rows = heads·head_dim, ...] reordered per head to (0, d/2, 1,
    d/2+1, …): the pairs RoPE rotates side by side."""
    half = head_dim // 2
    within = torch.arange(head_dim).view(2, half).t().reshape(-1)
    return (torch.arange(0, rows, head_dim)[:, None] + within).reshape(-1)


def _pair_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """w's rows (a q/k norm's weight over one head) in `_paired_order`."""
    return w[_paired_order(w.shape[0], head_dim).to(w.device)]


def _cat_bias(*biases: torch.Tensor | None) -> torch.Tensor | None:
    return None if biases[0] is None else torch.cat(biases)  # all or none (one config flag)


def fused_weights(model: CausalLM) -> tuple[RowBlocks, list[tuple], list[torch.Tensor | None]]:
    """(the lm_head with the final norm folded in; per layer its weights [out, in] each followed by
    its bias or None — q|k|v, o, gate|up, down; per layer the per-head q|k norm weights [H + Hkv, d]
    in the paired order, q's scaled by 1/sqrt(head_dim), or None)."""
    body, cfg = model.model, model.config
    d, heads, kv_heads = cfg.dim_head, cfg.num_attention_heads, cfg.num_key_value_heads
    # rsqrt(sum(x²) + n·eps) · sqrt(n) = rsqrt(mean(x²) + eps): the sqrt(n) goes into the weights.
    root_n = cfg.hidden_size ** 0.5
    lm_head = RowBlocks([(model.lm_head.weight, None, 1.0)], body.norm.weight * root_n)
    # q carries attention's 1/sqrt(head_dim), so the scores need no scaling; a q norm would undo
    # a scale in the q weights, so with one the scale goes into the norm's weight instead.
    q_scale = 1.0 if cfg.qk_norm else d ** -0.5
    layers, qk_norms = [], []
    for layer in body.layers:
        att, mlp = layer.self_attn, layer.mlp
        paired = [_paired_order(att.q_proj.weight.shape[0], d), _paired_order(att.k_proj.weight.shape[0], d)]
        wqkv = RowBlocks([(att.q_proj.weight, paired[0], q_scale), (att.k_proj.weight, paired[1], 1.0),
                          (att.v_proj.weight, None, 1.0)], layer.input_layernorm.weight * root_n)
        bqkv = None if att.q_proj.bias is None else torch.cat(
            [att.q_proj.bias[paired[0]] * q_scale, att.k_proj.bias[paired[1]], att.v_proj.bias])
        wgu = RowBlocks([(mlp.gate_proj.weight, None, 1.0), (mlp.up_proj.weight, None, 1.0)],
                        layer.post_attention_layernorm.weight * root_n)
        qk_norms.append(None if att.q_norm is None else torch.cat([
            (_pair_rows(att.q_norm.weight, d) * d ** -0.5).expand(heads, d),
            _pair_rows(att.k_norm.weight, d).expand(kv_heads, d)]))
        layers.append((wqkv, bqkv, att.o_proj.weight, att.o_proj.bias, wgu,
                       _cat_bias(mlp.gate_proj.bias, mlp.up_proj.bias), mlp.down_proj.weight, mlp.down_proj.bias))
    return lm_head, layers, qk_norms
