"""Decoder-transformer shapes: exact parameter counts, FLOPs per token and KV-cache bytes.

A block is RMSNorm → attention (q, k, v, o; grouped-query; per-family biases and q/k norms) →
RMSNorm → SwiGLU MLP (gate, up, down), or a sparse MoE of `experts` such MLPs of which each token
runs `experts_per_token` (Mixtral: all experts count in the parameters and the weight memory, only
the active ones in the FLOPs per token). Critics and reward/cost models replace the LM head by a
scalar head (`head="scalar"`). HF folders are read through the model families (families.py), so
the simulator plans only what the runtime can run. Presets are the published configs; their
counts are checked against the published totals in the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import SPEC_SUFFIXES, load_model_file
from hybridflow.simulator.names import lookup
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig, Head
from hybridflow.simulator.vocabulary.families import FAMILIES, read_hf_config
from hybridflow.simulator.vocabulary.units import BF16

__all__ = ["MODEL_PRESETS", "Head", "ModelSpec", "model_preset", "preset_if_named", "resolve_model"]


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    ffn: PositiveInt
    vocab: PositiveInt
    tied_embeddings: bool = False
    attention_bias: bool = False  # a bias on q, k and v (Qwen2; Llama's `attention_bias` also sets o_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head q and k RMSNorm (Qwen3)
    head_dim: PositiveInt | None = None  # defaults to hidden // heads
    family: str = "llama"  # the runtime builds (and writes config.json as) this family
    experts: PositiveInt | None = None  # a sparse MoE feed-forward of this many experts per layer; None: dense
    experts_per_token: PositiveInt = 2  # the top-k each token is routed to
    # The shortest sliding window of any layer (None: none). Priced as full attention; it only decides
    # whether the runtime can compute a prompt once for all of its samples (vocabulary/execution.py shares_prompts).
    attention_window: PositiveInt | None = None
    # The longest sequence (prompt + response) the model takes: its HF config's max_position_embeddings.
    # None: not stated (not checked). A plan's or search's prompt_len + response_len must fit in it.
    context_len: PositiveInt | None = None

    @model_validator(mode="after")
    def _shape(self):
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.experts is not None and self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} exceeds experts {self.experts}")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family '{self.family}'; supported: {', '.join(FAMILIES)}")
        return self

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    # ---- parameters -------------------------------------------------------------------------
    def layer_params(self, active: bool = False) -> int:
        """One decoder layer's parameters; `active`: those one token uses (its top-k experts and the router)."""
        h, d = self.hidden, self.dim_head
        q = h * self.heads * d
        kv = 2 * h * self.kv_heads * d
        o = self.heads * d * h
        bias = (self.heads + 2 * self.kv_heads) * d if self.attention_bias else 0
        bias += h if self.o_bias else 0
        mlp = 3 * h * self.ffn + (2 * self.ffn + h if self.mlp_bias else 0)
        if self.experts is not None:  # the router (hidden -> experts) and the experts one token runs
            mlp = mlp * (self.experts_per_token if active else self.experts) + h * self.experts
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return q + kv + o + bias + mlp + norms

    def num_params(self, head: Head = "lm") -> int:
        embed = self.vocab * self.hidden
        if head == "scalar":
            out = self.hidden + 1  # value head: hidden -> 1 with bias
        else:
            out = 0 if self.tied_embeddings else self.vocab * self.hidden
        return embed + self.layers * self.layer_params() + self.hidden + out

    def num_tensors(self, head: Head = "lm") -> int:
        """Weight tensors of the HF checkpoint (what a weight sync gathers and loads one by one): per layer q, k, v,
        o, the MLP's three (each expert's, and the router), two norms (and q/k norms, biases); embeddings, final
        norm and the head."""
        mlp = 3 * (self.experts or 1) + (1 if self.experts else 0) + (3 * (self.experts or 1) if self.mlp_bias else 0)
        per_layer = 4 + mlp + 2 + (2 if self.qk_norm else 0) + (3 if self.attention_bias else 0) + int(self.o_bias)
        return self.layers * per_layer + 2 + (0 if self.tied_embeddings and head == "lm" else 1)

    def expert_params(self) -> int:
        """The experts' parameters over all layers (0 for a dense model): what expert parallelism splits."""
        if self.experts is None:
            return 0
        return self.layers * self.experts * (3 * self.hidden * self.ffn + (2 * self.ffn + self.hidden if self.mlp_bias else 0))

    def matmul_params(self, head: Head = "lm") -> int:
        """Parameters that take part in a matmul per token (the embedding lookup does not; of a MoE, the
        experts the token is routed to)."""
        out = self.hidden if head == "scalar" else self.vocab * self.hidden
        return self.layers * self.layer_params(active=True) + out

    # ---- compute and memory per token -------------------------------------------------------
    def forward_flops_per_token(self, context: float, head: Head = "lm") -> float:
        """Forward FLOPs for one token attending to `context` tokens: 2·N_matmul + attention
        (QKᵀ and AV: 2·2·layers·context·heads·head_dim)."""
        attn = 4 * self.layers * context * self.heads * self.dim_head
        return 2 * self.matmul_params(head) + attn

    def sequence_forward_flops(self, seq_len: int, head: Head = "lm") -> float:
        """Forward FLOPs of a whole causal sequence: each token attends to (seq_len+1)/2 on average."""
        return seq_len * self.forward_flops_per_token((seq_len + 1) / 2, head)

    def kv_bytes_per_token(self, bytes_per_elem: int = BF16) -> int:
        return 2 * self.layers * self.kv_heads * self.dim_head * bytes_per_elem

    def weight_bytes(self, head: Head = "lm", bytes_per_param: int = BF16) -> int:
        return self.num_params(head) * bytes_per_param

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_decoder_config(cls, cfg: DecoderConfig, name: str) -> ModelSpec:
        return cls(
            name=name, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, ffn=cfg.intermediate_size, vocab=cfg.vocab_size,
            tied_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
            mlp_bias=cfg.mlp_bias, qk_norm=cfg.qk_norm, head_dim=cfg.head_dim, family=cfg.family,
            experts=cfg.num_local_experts, experts_per_token=cfg.num_experts_per_tok,
            attention_window=cfg.shortest_window, context_len=cfg.max_position_embeddings,
        )

    def decoder_config(self, **overrides) -> DecoderConfig:
        """The runnable decoder of this shape (e.g. the "tiny" preset), with HF-named overrides."""
        fields = dict(
            family=self.family, vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, tie_word_embeddings=self.tied_embeddings, qkv_bias=self.attention_bias,
            o_bias=self.o_bias, mlp_bias=self.mlp_bias, qk_norm=self.qk_norm,
            num_local_experts=self.experts, num_experts_per_tok=self.experts_per_token,
        )
        if self.context_len is not None:
            fields["max_position_embeddings"] = self.context_len
        return DecoderConfig(**{**fields, **overrides})

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face `config.json` (or a folder holding one) through its model family:
        a family or option the runtime cannot run is a one-line HflowError here, at plan time."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise HflowError(f"{p}: no config.json here; pass a Hugging Face model folder or its config.json")
        try:
            cfg = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HflowError(f"{p}: not valid JSON; a Hugging Face config.json is expected") from None
        read = read_hf_config(cfg, str(p))
        return cls.from_decoder_config(read.decoder, name or cfg.get("_name_or_path") or p.parent.name)


def _m(name, layers, hidden, heads, kv_heads, ffn, vocab, **kw) -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     vocab=vocab, **kw)


_QWEN2 = dict(family="qwen2", attention_bias=True)
_QWEN3 = dict(family="qwen3", qk_norm=True, head_dim=128)

# Published configs (Hugging Face config.json of each release: meta-llama/Llama-2-{7b,13b,70b}-hf,
# codellama/CodeLlama-34b-hf, meta-llama/Meta-Llama-3-{8B,70B}, meta-llama/Llama-3.1-{8B,70B},
# Qwen/Qwen2.5-{7B,32B,72B} (the base releases: max_position_embeddings 131072; the -Instruct ones say 32768),
# Qwen/Qwen3-{8B,32B}, mistralai/Mixtral-8x7B-v0.1); context_len is each one's max_position_embeddings.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _m("llama2-7b", 32, 4096, 32, 32, 11008, 32000, context_len=4096),
        _m("llama2-13b", 40, 5120, 40, 40, 13824, 32000, context_len=4096),
        _m("llama2-70b", 80, 8192, 64, 8, 28672, 32000, context_len=4096),
        _m("codellama-34b", 48, 8192, 64, 8, 22016, 32000, context_len=16384),
        _m("llama3-8b", 32, 4096, 32, 8, 14336, 128256, context_len=8192),
        _m("llama3-70b", 80, 8192, 64, 8, 28672, 128256, context_len=8192),
        _m("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, context_len=131072),
        _m("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, context_len=131072),
        _m("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, context_len=131072, **_QWEN2),
        _m("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, context_len=131072, **_QWEN2),
        _m("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, context_len=131072, **_QWEN2),
        _m("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, context_len=40960, **_QWEN3),
        _m("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, context_len=40960, **_QWEN3),
        _m("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, family="mixtral", experts=8, experts_per_token=2,
           context_len=32768),
        # The embedded default's policy: small enough to train on two CPU cores (the decoder's default context).
        _m("tiny", 4, 128, 4, 4, 512, 64, context_len=2048),
    ]
}


def model_preset(name: str) -> ModelSpec:
    """A published config by name (any case; a near miss is answered with "did you mean")."""
    return MODEL_PRESETS[lookup(name, MODEL_PRESETS, "model preset", "or pass a HF model folder")]


def preset_if_named(data):
    """A pydantic before-validator's helper: `"model": "llama2-7b"` in a file means that preset
    (an unknown name lists the known ones)."""
    if isinstance(data, dict) and isinstance(data.get("model"), str):
        data = {**data, "model": model_preset(data["model"])}
    return data


def hf_folder(ref: str) -> Path | None:
    """The Hugging Face model folder `ref` names (a folder, or the config.json in one), absolute;
    None when `ref` is a preset name or a ModelSpec file."""
    p = Path(ref)
    if p.is_dir():
        return p.resolve()
    if p.name == "config.json":
        return p.resolve().parent
    return None


def resolve_model(ref: str) -> ModelSpec:
    """A preset name, a HF model folder / config.json, or a YAML/JSON ModelSpec file."""
    folder = hf_folder(ref)
    if folder is not None:
        return ModelSpec.from_hf_config(folder)
    p = Path(ref)
    if p.suffix in SPEC_SUFFIXES and p.exists():
        return load_model_file(ModelSpec, p)
    return model_preset(ref)
