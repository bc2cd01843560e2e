"""The decoder every supported model family runs, readable top to bottom (nanoGPT / TorchTitan style).

RMSNorm → grouped-query attention with RoPE → RMSNorm → SwiGLU MLP (or a sparse mixture of SwiGLU
experts, Mixtral: models/moe.py), repeated; a final RMSNorm;
then either an LM head (`CausalLM`) or a scalar head (`ScoreModel`, for critics and reward/cost
models). What differs between Llama, Mistral, Qwen2 and Qwen3 is a `DecoderConfig` option, not a
copy of this file: biases on q/k/v, o and the MLP; per-head q/k RMSNorm before RoPE (Qwen3); RoPE
frequency scaling (linear, llama3); a sliding attention window (Mistral, optionally Qwen).
Module and parameter names are exactly those of Hugging Face (`model.layers.0.self_attn.q_proj.weight`,
…), so state dicts load directly and tensor-parallel plans (simulator/vocabulary/families.py) name the layers.

The model knows nothing of parallelism. Attention reshapes with the LOCAL head count
(`view(b, s, -1, head_dim)`), so q/k/v column-sharded by DTensor's `parallelize_module` work
unchanged, and the KV cache is sized from the actual k/v tensors it receives. The attention core itself
(`Attention.core`, by default `sdpa_attention`) is a plug: the FSDP engine's Ulysses sequence parallelism
swaps in one that exchanges heads for sequence around it (engines/train/fsdp/ulysses.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.runtime.models.moe import SparseMoE
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig

# ---- building blocks --------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype (as HF does), scale in the input dtype.
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: DecoderConfig, device=None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] in fp32, rescaled as `cfg.rope_scaling` says (as
    transformers computes them: `linear` divides all by the factor; `llama3` divides the
    frequencies whose wavelength exceeds original_max/low_freq_factor, keeps those shorter than
    original_max/high_freq_factor, and blends linearly in between)."""
    d, rope = cfg.dim_head, cfg.rope_scaling
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and signed-sin tables [B, 1, S, head_dim] for integer positions [B, S], computed in fp32.

    HF's rotate_half(x) = cat(-x2, x1) equals roll(x, d/2) * cat(-1, +1), so the sign is folded
    into the sin table once per forward instead of negating x in every layer.
    """
    freqs = positions[:, None, :, None].float() * inv_freq.float()
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, S, head_dim] (HF's half-split layout)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class KVCache:
    """Preallocated keys and values for incremental decoding, one slot per layer.

    Each layer's buffers are allocated on its first write, shaped from the k/v it receives
    ([B, local_kv_heads, max_len, head_dim]), so a tensor-parallel shard gets a shard-sized cache.
    `length` is the number of positions already filled; the model advances it after each forward.
    """

    def __init__(self, num_layers: int, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, h, s, d] at positions length..length+s; return all keys/values so far."""
        if self.keys[layer] is None:
            b, h, _, d = k.shape
            self.keys[layer] = k.new_empty(b, h, self.max_len, d)
            self.values[layer] = v.new_empty(b, v.shape[1], self.max_len, v.shape[3])
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   window: int | None = None) -> torch.Tensor:
    """Scaled dot-product attention of q [B, h, S, d] over k/v [B, kv_h, past+S, d]: `mask` as the decoder
    builds it (additive or boolean, the window already in it), or None for plain causal attention (one query:
    every key). Grouped-query attention: each kv head serves h/kv_h q heads (no copy of the cache)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:  # plain causal self-attention over the whole sequence (training)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.dim_head
        self.window = cfg.attention_window(layer)  # None: every earlier key
        h, d = cfg.hidden_size, cfg.dim_head
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.o_bias)
        # Qwen3: each head's q and k normalised over head_dim (one weight shared by all heads), before RoPE.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # The attention core (q, k, v [B, heads, S, head_dim], mask, window) -> [B, heads, S, head_dim]: a
        # plain function, so no module or parameter name changes; a parallelization step may swap it (Ulysses
        # sequence parallelism: engines/train/fsdp/ulysses.py).
        self.core = sdpa_attention

    def forward(self, x, cos, sin, mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, whatever share of the heads this rank holds.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        out = self.core(q, k, v, mask, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        # Declared in HF's order, so state dicts list the same names in the same order.
        self.self_attn = Attention(cfg, layer)
        if cfg.is_moe:
            self.block_sparse_moe = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.feed_forward(self.post_attention_layernorm(x))


# ---- masks and positions ----------------------------------------------------------------------


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip padding: the first real token of each row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def attention_bias_mask(key_mask: torch.Tensor, q_len: int, past: int, window: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, q_len, past+q_len]: causal, not padding and, with a sliding `window`,
    no key `window` or more slots back (slots count padding, as transformers counts them).

    Query i (absolute slot past+i) sees key j if j <= past+i and key j is not padding; it
    always sees itself, so a padding row never has every key masked (which would give NaN).
    """
    total = past + q_len
    if q_len == 1:  # decode step: the new token sees every real key in its window, and itself
        mask = key_mask[:, :total].bool().clone()
        if window is not None:
            mask[:, :max(0, total - window)] = False
        mask[:, -1] = True
        return mask[:, None, None, :]
    q_pos = torch.arange(past, total, device=key_mask.device)[:, None]
    k_pos = torch.arange(total, device=key_mask.device)[None, :]
    causal = k_pos <= q_pos
    if window is not None:
        causal &= k_pos > q_pos - window
    mask = causal[None] & key_mask[:, None, :total].bool()
    mask |= (k_pos == q_pos)[None]
    return mask[:, None]


# ---- the models -------------------------------------------------------------------------------


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm: hidden states [B, S, hidden].

    A pipeline stage (engines/train/fsdp/pipeline.py) sets `embed_tokens` / `norm` to None where another stage
    holds them and keeps only its layers; the model then maps hidden states to hidden states."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def decoder_layers(self) -> list[DecoderLayer]:
        # A pipeline stage keeps its layers in a ModuleDict keyed by their global index (HF names).
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S]; attention_mask [B, past+S] (1 = real token, 0 = padding), or a boolean
        [B, 1, S, S] of which keys each query sees (no cache, no sliding window: the caller's layout), or None;
        position_ids [B, S], by default counted from the mask so left padding does not shift them."""
        b, s = input_ids.shape[:2]  # a later pipeline stage gets hidden states [B, S, hidden]
        past = cache.length if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:past + s]
            else:
                position_ids = torch.arange(past, past + s, device=input_ids.device).expand(b, s)
        x = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)
        layers = self.decoder_layers()
        # One additive mask per distinct window (built once here rather than in every layer).
        masks = {w: _additive_mask(attention_mask, b, s, past, w, x) for w in {la.self_attn.window for la in layers}}
        for layer in layers:
            x = layer(x, cos, sin, masks[layer.self_attn.window], cache)
        if cache is not None:
            cache.length += s
        return self.norm(x) if self.norm is not None else x


def _additive_mask(attention_mask, b: int, s: int, past: int, window: int | None, x: torch.Tensor):
    """The additive mask (0 or dtype min) [B, 1, S, past+S] a layer with `window` needs, or None
    for plain causal attention over [0, S) or one new token that sees the whole cache."""
    if attention_mask is not None and attention_mask.dim() == 4:  # a caller's [B, 1, S, S] (True: sees): SDPA takes it
        return attention_mask
    total = past + s
    window = window if window is not None and total > window else None  # a window no key is beyond is none
    if attention_mask is None and window is None and not (past > 0 and s > 1):
        return None
    key_mask = attention_mask if attention_mask is not None else torch.ones(b, total, dtype=torch.bool,
                                                                            device=x.device)
    mask = attention_bias_mask(key_mask, s, past, window)
    return torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, torch.finfo(x.dtype).min)


class _DecoderWithHead(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config.num_hidden_layers, max_len)

    @classmethod
    def empty(cls, cfg: DecoderConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        """The model with uninitialised weights on `device` in `dtype`, for a checkpoint to fill
        (no random initialisation of weights that are about to be overwritten)."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        model.tie_weights()
        model.model.inv_freq = rope_inv_freq(cfg, device=device)  # fp32, whatever the weights' dtype
        return model

    def tie_weights(self) -> None:
        """Share the LM head with the embedding where the config ties them (no head, no tie)."""

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF's initialisation: normal(0, initializer_range) for matrices, zero biases, unit norms.
        Also recomputes the RoPE buffer (needed after building on the meta device)."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std, generator=generator)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, std, generator=generator)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        self.model.inv_freq = rope_inv_freq(self.config, device=self.model.embed_tokens.weight.device)


class CausalLM(_DecoderWithHead):
    """Decoder + LM head: logits [B, S, vocab] (HF's `*ForCausalLM`)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None,
                last_only: bool = False, logits_from: int = 0, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """`last_only` projects only the last position (generation needs no more); `logits_from`, only
        positions from that one on (logits [B, S - logits_from, V]: a trainer scoring the responses);
        `logits_at`, only the positions at these flat indices into [B·S] (logits [*logits_at.shape, V])."""
        h = self.model(input_ids, attention_mask, position_ids, cache)
        if self.lm_head is None:  # a pipeline stage before the last
            return h
        if logits_at is not None:
            return self.lm_head(h.flatten(0, 1)[logits_at])
        return self.lm_head(h[:, -1:] if last_only else h[:, logits_from:] if logits_from else h)


class ScoreModel(_DecoderWithHead):
    """Decoder + scalar head `score` (hidden -> 1, with bias): values [B, S] in fp32.

    HF's `*ForSequenceClassification` with one label (its `score` has no bias; ours starts at 0
    when read from one). Critics read a value per token; reward and cost models read the value
    at the last real token.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=True)
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None):
        h = self.model(input_ids, attention_mask, position_ids, cache)
        return self.score(h).squeeze(-1).float() if self.score is not None else h


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values [B, S] at each row's last real token (right- or left-padded rows): [B]."""
    s = attention_mask.shape[1]
    idx = s - 1 - attention_mask.long().flip(-1).argmax(-1)
    return values.gather(1, idx[:, None]).squeeze(1)


def num_params(model: nn.Module) -> int:
    """Distinct parameters (a tied LM head counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


__all__ = ["DecoderModel", "CausalLM", "ScoreModel", "KVCache", "RMSNorm", "rms_norm",
           "apply_rope", "sdpa_attention", "rope_cos_sin", "rope_inv_freq",
           "positions_from_mask", "attention_bias_mask", "last_token_values", "num_params"]
