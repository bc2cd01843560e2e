"""A Llama-family decoder, readable top to bottom (nanoGPT / TorchTitan style).

RMSNorm → grouped-query attention with RoPE → RMSNorm → SwiGLU MLP, repeated; a final RMSNorm;
then either an LM head (`LlamaForCausalLM`) or a scalar head (`LlamaForScore`, for critics and
reward/cost models). Module and parameter names are exactly those of Hugging Face
`LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`, …) so state dicts load directly and
tensor-parallel plans can name the layers.

The model knows nothing of parallelism. Attention reshapes with the LOCAL head count
(`view(b, s, -1, head_dim)`), so q/k/v column-sharded by DTensor's `parallelize_module` work
unchanged, and the KV cache is sized from the actual k/v tensors it receives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator
from torch import nn

from hybridflow.simulator.model import ModelSpec


class LlamaConfig(BaseModel):
    """The shape of a Llama-family model; field names are those of the HF `config.json`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt | None = None  # defaults to hidden_size // num_attention_heads
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    max_position_embeddings: PositiveInt = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: PositiveFloat = 0.02

    @model_validator(mode="after")
    def _shape(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}; set head_dim explicitly")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        return self

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_spec(cls, spec: ModelSpec, **overrides) -> LlamaConfig:
        """The runnable config of a simulator `ModelSpec` (e.g. the "tiny" preset)."""
        fields = dict(
            vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
            num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
            head_dim=spec.head_dim, tie_word_embeddings=spec.tied_embeddings, attention_bias=spec.attention_bias,
        )
        return cls(**{**fields, **overrides})

    def to_spec(self, name: str = "llama") -> ModelSpec:
        return ModelSpec(
            name=name, layers=self.num_hidden_layers, hidden=self.hidden_size, heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads, ffn=self.intermediate_size, vocab=self.vocab_size,
            tied_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias, head_dim=self.head_dim,
        )


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


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.head_dim = cfg.dim_head
        h, d = cfg.hidden_size, cfg.dim_head
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the local head count, whatever share of the heads this rank holds.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        # Grouped-query attention: each kv head serves heads/kv_heads q heads (no copy of the cache).
        gqa = q.shape[1] != k.shape[1]
        if mask is None:  # plain causal self-attention over the whole sequence (training)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        # Declared in HF's order, so state dicts list the same names in the same order.
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- masks and positions ----------------------------------------------------------------------


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip padding: the first real token of each row is position 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def attention_bias_mask(key_mask: torch.Tensor, q_len: int, past: int) -> torch.Tensor:
    """Boolean mask [B, 1, q_len, past+q_len]: causal and not padding.

    Query i (absolute position past+i) sees key j if j <= past+i and key j is not padding; it
    always sees itself, so a padding row never has every key masked (which would give NaN).
    """
    total = past + q_len
    if q_len == 1:  # decode step: the new token sees every real key, and itself
        mask = key_mask[:, :total].bool().clone()
        mask[:, -1] = True
        return mask[:, None, None, :]
    q_pos = torch.arange(past, total, device=key_mask.device)[:, None]
    k_pos = torch.arange(total, device=key_mask.device)[None, :]
    causal = k_pos <= q_pos
    mask = causal[None] & key_mask[:, None, :total].bool()
    mask |= (k_pos == q_pos)[None]
    return mask[:, None]


# ---- the models -------------------------------------------------------------------------------


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm: hidden states [B, S, hidden].

    A pipeline stage (engines/pipeline.py) sets `embed_tokens` / `norm` to None where another stage
    holds them and keeps only its layers; the model then maps hidden states to hidden states."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", self._inv_freq(cfg), persistent=False)
        self.rope_theta, self.head_dim = cfg.rope_theta, cfg.dim_head

    @staticmethod
    def _inv_freq(cfg: LlamaConfig, device=None) -> torch.Tensor:
        d = cfg.dim_head
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [B, S]; attention_mask [B, past+S] (1 = real token, 0 = padding) or None;
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
        if attention_mask is not None:
            mask = attention_bias_mask(attention_mask, s, past)
        elif past > 0 and s > 1:
            mask = attention_bias_mask(torch.ones(b, past + s, dtype=torch.bool, device=x.device), s, past)
        else:
            mask = None  # causal over [0, S), or one new token that sees the whole cache
        if mask is not None:  # additive form, built once here rather than converted in every layer
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(
                ~mask, torch.finfo(x.dtype).min)
        # A pipeline stage keeps its layers in a ModuleDict keyed by their global index (HF names).
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            x = layer(x, cos, sin, mask, cache)
        if cache is not None:
            cache.length += s
        return self.norm(x) if self.norm is not None else x


class _LlamaBase(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config.num_hidden_layers, max_len)

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
        self.model.inv_freq = LlamaModel._inv_freq(self.config, device=self.model.embed_tokens.weight.device)


class LlamaForCausalLM(_LlamaBase):
    """Decoder + LM head: logits [B, S, vocab]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """`last_only` projects only the last position (generation needs no more)."""
        h = self.model(input_ids, attention_mask, position_ids, cache)
        if self.lm_head is None:  # a pipeline stage before the last
            return h
        return self.lm_head(h[:, -1:] if last_only else h)


class LlamaForScore(_LlamaBase):
    """Decoder + scalar head `score` (hidden -> 1, with bias): values [B, S] in fp32.

    Critics read a value per token; reward and cost models read the value at the last real token.
    """

    def __init__(self, cfg: LlamaConfig):
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


__all__ = ["LlamaConfig", "LlamaModel", "LlamaForCausalLM", "LlamaForScore", "KVCache", "RMSNorm", "rms_norm",
           "apply_rope", "rope_cos_sin",
           "positions_from_mask", "attention_bias_mask", "last_token_values", "num_params"]
