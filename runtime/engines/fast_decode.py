"""The decode step of a plain (unsharded, hook-free) `LlamaForCausalLM` as functions over its weights.

Generation spends its time in one-token steps where a tiny model's cost is mostly per-call
overhead: ~50 module calls and ~800 dispatched ops per step. This step runs the same math as
`llama.py` (it reuses its `rms_norm`, `rope_cos_sin`, `apply_rope` and `KVCache`) on 2-D
activations [B, hidden], without module calls, which makes a CPU decode step ~1.4× cheaper. It
reads the weights in place (no copy), so an update between generations is seen.

Anything else — a tensor-parallel model (DTensor weights), an FSDP-wrapped one, a model with
hooks, a subclass — goes through the modules, which is always correct; `supports` decides.
The tests check both paths give the same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.runtime.models.llama import KVCache, LlamaForCausalLM, apply_rope, rms_norm, rope_cos_sin


def supports(model: torch.nn.Module) -> bool:
    """True for an exact `LlamaForCausalLM` with plain-tensor weights and no hooks on any module."""
    if type(model) is not LlamaForCausalLM:
        return False
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return False  # DTensor (tensor-parallel or FSDP) weights: the modules' hooks must run
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class FastDecoder:
    def __init__(self, model: LlamaForCausalLM):
        body, cfg = model.model, model.config
        self.eps, self.head_dim = cfg.rms_norm_eps, cfg.dim_head
        self.embed, self.inv_freq = body.embed_tokens.weight, body.inv_freq
        self.final_norm, self.lm_head = body.norm.weight, model.lm_head.weight
        self.layers = [
            (layer.input_layernorm.weight, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
             layer.self_attn.o_proj, layer.post_attention_layernorm.weight, layer.mlp.gate_proj,
             layer.mlp.up_proj, layer.mlp.down_proj)
            for layer in body.layers
        ]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
             cache: KVCache) -> torch.Tensor:
        """tokens [B], positions [B, 1], additive mask [B, 1, 1, cache.length+1] or None -> logits [B, V]."""
        b, d, eps = tokens.shape[0], self.head_dim, self.eps
        x = self.embed[tokens]  # [B, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # [B, 1, 1, head_dim]
        for i, (norm1, wq, wk, wv, wo, norm2, wg, wu, wd) in enumerate(self.layers):
            h = rms_norm(x, norm1, eps)
            q = F.linear(h, wq.weight, wq.bias).view(b, -1, 1, d)  # one token: [B, heads, 1, d]
            k = F.linear(h, wk.weight, wk.bias).view(b, -1, 1, d)
            v = F.linear(h, wv.weight, wv.bias).view(b, -1, 1, d)
            keys, values = cache.update(i, apply_rope(k, cos, sin), v)
            q = apply_rope(q, cos, sin)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=q.shape[1] != keys.shape[1])
            x = x + F.linear(attn.view(b, -1), wo.weight, wo.bias)
            h = rms_norm(x, norm2, eps)
            x = x + F.linear(F.silu(F.linear(h, wg.weight, wg.bias)) * F.linear(h, wu.weight, wu.bias),
                             wd.weight, wd.bias)
        cache.length += 1
        return F.linear(rms_norm(x, self.final_norm, eps), self.lm_head)
