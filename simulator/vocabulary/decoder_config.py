"""The options of the one decoder the runtime builds, under Hugging Face `config.json` names.

Every supported family (families.py) is this decoder with some options on: RMSNorm → grouped-query
attention with RoPE (optionally biased q/k/v and o, per-head q/k RMSNorm, a sliding window) →
RMSNorm → SwiGLU MLP (optionally biased), or a sparse mixture of SwiGLU experts with top-k routing
(Mixtral). Torch-free, so the simulator, the folder check and the
runtime share it; runtime/models/decoder.py is the model it describes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator

Head = Literal["lm", "scalar"]  # an LM head (policy, reference) or a scalar head (critic, reward, cost)
RopeType = Literal["default", "linear", "llama3"]
LayerType = Literal["full_attention", "sliding_attention"]


class RopeScaling(BaseModel):
    """How the rotary frequencies are rescaled (transformers' `rope_parameters`): `linear` divides
    every frequency by `factor`; `llama3` divides the low frequencies only, blending in between."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rope_type: RopeType = "default"
    factor: PositiveFloat = 1.0
    low_freq_factor: PositiveFloat | None = None  # llama3
    high_freq_factor: PositiveFloat | None = None  # llama3
    original_max_position_embeddings: PositiveInt | None = None  # llama3

    @model_validator(mode="after")
    def _complete(self):
        if self.rope_type == "llama3":
            missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(f"llama3 rope scaling needs {', '.join(missing)}")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
        return self


class DecoderConfig(BaseModel):
    """The shape and options of one decoder model (what runtime/models/decoder.py builds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str = "llama"  # the families.py entry that names it in config.json
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt | None = None  # defaults to hidden_size // num_attention_heads
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: PositiveInt = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q, k and v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries a bias (Llama's attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: PositiveInt | None = None  # keys further back than this are not attended to
    layer_types: tuple[LayerType, ...] | None = None  # which layers use the window; None: all of them
    initializer_range: PositiveFloat = 0.02
    # A sparse MoE feed-forward (Mixtral): this many SwiGLU experts of intermediate_size in every layer,
    # each token routed to num_experts_per_tok of them. None: the dense MLP.
    num_local_experts: PositiveInt | None = None
    num_experts_per_tok: PositiveInt = 2

    @model_validator(mode="after")
    def _shape(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}; set head_dim explicitly")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.dim_head % 2:
            raise ValueError(f"head_dim {self.dim_head} must be even (RoPE rotates pairs)")
        if self.num_local_experts is not None and self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_local_experts "
                             f"{self.num_local_experts}")
        if self.num_local_experts is not None and self.mlp_bias:
            raise ValueError("mlp_bias is not supported with experts (Mixtral's experts have no bias)")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is "
                             f"{self.num_hidden_layers}")
        return self

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts is not None

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (None: it attends to every earlier key)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def shortest_window(self) -> int | None:
        """The shortest sliding window of any layer (None: every layer attends to every earlier key)."""
        windows = [w for i in range(self.num_hidden_layers) if (w := self.attention_window(i)) is not None]
        return min(windows, default=None)
