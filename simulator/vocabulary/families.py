"""Model families: one entry per family says everything the simulator and the runtime need of it.

In the spirit of TorchTitan's per-model spec, a `Family` names its Hugging Face `model_type`s and
architectures, says how its `config.json` reads into a `DecoderConfig` (which decoder options it
turns on), its tensor-parallel plan and its pipeline stage cut (both as data: module names), and
whether the fused decode path runs it. Every family keeps Llama's HF module and tensor names
(`model.layers.{i}.self_attn.q_proj.weight`, …), listed once in `tensor_shapes`; Mixtral's sparse MoE
replaces the MLP by `block_sparse_moe.gate` (the router) and `block_sparse_moe.experts.{e}.w1/w3/w2`
(gate, up, down), the names of its published checkpoints (which transformers 5 writes too).

Torch-free: the simulator (`ModelSpec.from_hf_config`), the folder check and the runtime read HF
configs through `read_hf_config` here. Semantics follow transformers' own config classes:
`rope_scaling` (older files) wins over `rope_parameters`, whose `rope_theta` wins over the
top-level one; Mistral slides its window over every layer, Qwen2/Qwen3 only when
`use_sliding_window` is set, over the layers `layer_types` marks; Qwen3's head_dim defaults to 128.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError

from hybridflow.simulator.errors import HflowError, describe_validation_error
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig, Head, RopeScaling, RopeType


class TensorParallelPlan(BaseModel):
    """Which modules tensor parallelism splits, by name (everything else is replicated)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    colwise: tuple[str, ...]  # in each decoder layer: output features split (heads, MLP units)
    rowwise: tuple[str, ...]  # in each decoder layer: input features split, outputs summed (all-reduce)
    head_norms: tuple[str, ...] = ()  # in each layer: norms over each local head (weights replicated)
    vocab: tuple[str, ...] = ("model.embed_tokens", "lm_head")  # split along the vocabulary (untied only)


class StageCut(BaseModel):
    """How pipeline parallelism cuts the model: contiguous `layers`, `first` modules on the first
    stage, `last` modules on the last (module paths; a head the model lacks is skipped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: str = "model.layers"
    first: tuple[str, ...] = ("model.embed_tokens",)
    last: tuple[str, ...] = ("model.norm", "lm_head", "score")


class Family(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    model_types: tuple[str, ...]  # HF `model_type`; the first is written
    causal_lm: str  # HF architecture of the LM-head model
    score_model: str  # HF `*ForSequenceClassification`: our scalar head (critic, reward, cost)
    # "config": `attention_bias` puts a bias on q, k, v and o; "qkv": q, k, v always, o never; "none"
    attention_bias: Literal["config", "qkv", "none"]
    reads_mlp_bias: bool  # the config's `mlp_bias` key
    qk_norm: bool
    rope_types: tuple[RopeType, ...]
    # "all_layers": `sliding_window` on every layer; "layer_types": when `use_sliding_window`, on the
    # layers `layer_types` (or `max_window_layers`) marks; "none": no window
    sliding_window: Literal["none", "all_layers", "layer_types"]
    default_head_dim: PositiveInt | None = None  # when config.json has none (None: hidden / heads)
    default_sliding_window: PositiveInt | None = None
    default_max_positions: PositiveInt
    fused_decode: bool  # engines/cpu_decode/fast_decode.py runs it (else the module path generates)
    experts: bool = False  # a sparse MoE in every layer: `num_local_experts`, `num_experts_per_tok` (Mixtral)
    # LoRA (vocabulary/lora.py): the linear layers an adapter may wrap, and those it wraps unless told
    lora_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora_default: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    tp_plan: TensorParallelPlan
    stage_cut: StageCut = StageCut()

    def head_of(self, architecture: str) -> Head | None:
        return {self.causal_lm: "lm", self.score_model: "scalar"}.get(architecture)

    def architecture(self, head: Head) -> str:
        return self.causal_lm if head == "lm" else self.score_model


_ATTENTION_MLP = dict(colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                               "mlp.up_proj"),
                      rowwise=("self_attn.o_proj", "mlp.down_proj"))

LLAMA = Family(name="llama", model_types=("llama",), causal_lm="LlamaForCausalLM",
               score_model="LlamaForSequenceClassification", attention_bias="config", reads_mlp_bias=True,
               qk_norm=False, rope_types=("default", "linear", "llama3"), sliding_window="none",
               default_max_positions=2048, fused_decode=True, tp_plan=TensorParallelPlan(**_ATTENTION_MLP))
MISTRAL = Family(name="mistral", model_types=("mistral",), causal_lm="MistralForCausalLM",
                 score_model="MistralForSequenceClassification", attention_bias="none", reads_mlp_bias=False,
                 qk_norm=False, rope_types=("default",), sliding_window="all_layers", default_sliding_window=4096,
                 default_max_positions=131072, fused_decode=True, tp_plan=TensorParallelPlan(**_ATTENTION_MLP))
QWEN2 = Family(name="qwen2", model_types=("qwen2",), causal_lm="Qwen2ForCausalLM",
               score_model="Qwen2ForSequenceClassification", attention_bias="qkv", reads_mlp_bias=False,
               qk_norm=False, rope_types=("default",), sliding_window="layer_types", default_sliding_window=4096,
               default_max_positions=32768, fused_decode=True, tp_plan=TensorParallelPlan(**_ATTENTION_MLP))
QWEN3 = Family(name="qwen3", model_types=("qwen3",), causal_lm="Qwen3ForCausalLM",
               score_model="Qwen3ForSequenceClassification", attention_bias="config", reads_mlp_bias=False,
               qk_norm=True, rope_types=("default",), sliding_window="layer_types", default_sliding_window=4096,
               default_head_dim=128, default_max_positions=32768, fused_decode=True,
               tp_plan=TensorParallelPlan(**_ATTENTION_MLP, head_norms=("self_attn.q_norm", "self_attn.k_norm")))

# Tensor parallelism splits Mixtral's attention; its experts stay whole on each tp rank (the megatron
# backend splits them over ParallelConfig.ep instead).
MIXTRAL = Family(name="mixtral", model_types=("mixtral",), causal_lm="MixtralForCausalLM",
                 score_model="MixtralForSequenceClassification", attention_bias="none", reads_mlp_bias=False,
                 qk_norm=False, rope_types=("default",), sliding_window="all_layers", default_max_positions=131072,
                 fused_decode=False, experts=True,
                 # adapters on attention by default: each expert's own (w1, w3, w2) multiply the adapter count
                 lora_modules=("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"),
                 lora_default=("q_proj", "k_proj", "v_proj", "o_proj"),
                 tp_plan=TensorParallelPlan(colwise=_ATTENTION_MLP["colwise"][:3], rowwise=("self_attn.o_proj",)))

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL)}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
_BY_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in (f.causal_lm, f.score_model)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise HflowError(f"unknown model family '{name}'; supported: {', '.join(FAMILIES)}") from None


def supported_architectures() -> list[str]:
    return list(_BY_ARCHITECTURE)


# ---- reading a config.json --------------------------------------------------------------------


class HFModelConfig(BaseModel):
    """What a `config.json` says, read through its family."""

    model_config = ConfigDict(frozen=True)

    family: Family
    decoder: DecoderConfig
    head: Head
    architecture: str


_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _family_and_head(hf: dict[str, Any], source: str) -> tuple[Family, str, Head]:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type is None:  # hand-written configs: the architecture says it, else Llama (as before)
        fam = _BY_ARCHITECTURE.get(archs[0], LLAMA) if archs else LLAMA
    elif model_type in _BY_MODEL_TYPE:
        fam = _BY_MODEL_TYPE[model_type]
    else:
        raise HflowError(f"{source}: model_type '{model_type}' is not supported; supported: "
                         f"{', '.join(_BY_MODEL_TYPE)}")
    arch = archs[0] if archs else fam.causal_lm
    head = fam.head_of(arch)
    if head is None and arch in _BY_ARCHITECTURE:
        raise HflowError(f"{source}: architecture '{arch}' does not match model_type '{fam.model_types[0]}' "
                         f"(expected {fam.causal_lm} or {fam.score_model}); fix config.json")
    if head is None:
        raise HflowError(f"{source}: architecture '{arch}' is not supported; supported: "
                         f"{', '.join(supported_architectures())}")
    return fam, arch, head


def _rope(hf: dict[str, Any], fam: Family, source: str) -> tuple[float, RopeScaling]:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise HflowError(f"{source}: per-layer rope parameters are not supported; give one rope_parameters mapping")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in fam.rope_types:
        raise HflowError(f"{source}: rope_type '{rope_type}' is not supported for {fam.name}; supported: "
                         f"{', '.join(fam.rope_types)}")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HflowError(f"{source}: partial_rotary_factor {partial} is not supported; RoPE must cover the whole head")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {"rope_type": rope_type}
    if rope_type != "default":
        fields["factor"] = rope.get("factor")
    if rope_type == "llama3":
        fields.update(low_freq_factor=rope.get("low_freq_factor"), high_freq_factor=rope.get("high_freq_factor"),
                      original_max_position_embeddings=hf.get("original_max_position_embeddings")
                      or rope.get("original_max_position_embeddings")
                      or hf.get("max_position_embeddings", fam.default_max_positions))
    try:
        return theta, RopeScaling(**fields)
    except ValidationError as e:
        raise HflowError(describe_validation_error(e, f"{source}: rope_parameters")) from None


def _sliding(hf: dict[str, Any], fam: Family, layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    if fam.sliding_window == "none":
        return None, None
    window = hf.get("sliding_window", fam.default_sliding_window)
    if fam.sliding_window == "all_layers" or window is None:
        return window, None
    if not hf.get("use_sliding_window", False):
        return None, None
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(layers)]
    if all(t == "full_attention" for t in types):
        return None, None
    return window, (None if all(t == "sliding_attention" for t in types) else tuple(types))


def _experts(hf: dict[str, Any], fam: Family, source: str) -> dict[str, Any]:
    if not fam.experts:
        return {}
    if not hf.get("num_local_experts"):
        raise HflowError(f"{source}: a {fam.name} config.json needs num_local_experts (the experts per layer)")
    if hf.get("router_jitter_noise"):
        raise HflowError(f"{source}: router_jitter_noise {hf['router_jitter_noise']} is not supported; set it to 0")
    return dict(num_local_experts=hf["num_local_experts"], num_experts_per_tok=hf.get("num_experts_per_tok", 2))


def read_hf_config(hf: dict[str, Any], source: str = "config.json") -> HFModelConfig:
    """The family, decoder config and head of an HF `config.json` mapping; a one-line HflowError
    for anything the runtime cannot run (model_type, architecture, activation, rope type, shape)."""
    if not isinstance(hf, dict):
        raise HflowError(f"{source}: expected a JSON object of config fields, got {type(hf).__name__}")
    fam, arch, head = _family_and_head(hf, source)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HflowError(f"{source}: hidden_act '{act}' is not supported; supported: silu (SwiGLU)")
    missing = [k for k in _SHAPE_KEYS if hf.get(k) is None]
    if missing:
        raise HflowError(f"{source}: missing {', '.join(missing)}; a decoder config.json names its shape")
    if head == "scalar" and len(hf.get("id2label") or {"0": ""}) != 1:
        raise HflowError(f"{source}: a score model needs num_labels = 1 (one scalar per token), "
                         f"got {len(hf['id2label'])} labels")
    theta, scaling = _rope(hf, fam, source)
    experts = _experts(hf, fam, source)
    window, layer_types = _sliding(hf, fam, hf["num_hidden_layers"])
    bias = bool(hf.get("attention_bias", False))
    head_dim = hf.get("head_dim") or fam.default_head_dim
    if head_dim and head_dim * hf["num_attention_heads"] == hf["hidden_size"]:
        head_dim = None  # the default: one spelling per shape
    fields = {k: hf[k] for k in _SHAPE_KEYS} | dict(
        family=fam.name,
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings") or fam.default_max_positions,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias={"config": bias, "qkv": True, "none": False}[fam.attention_bias],
        o_bias=bias if fam.attention_bias == "config" else False,
        mlp_bias=bool(hf.get("mlp_bias", False)) if fam.reads_mlp_bias else False,
        qk_norm=fam.qk_norm, sliding_window=window, layer_types=layer_types, **experts,
    )
    for key in ("rms_norm_eps", "initializer_range"):
        if hf.get(key) is not None:
            fields[key] = hf[key]
    try:
        decoder = DecoderConfig(**fields)
    except ValidationError as e:
        raise HflowError(describe_validation_error(e, f"{source}: not a valid {fam.name} config")) from None
    return HFModelConfig(family=fam, decoder=decoder, head=head, architecture=arch)


# ---- writing a config.json --------------------------------------------------------------------


def _representable(cfg: DecoderConfig, fam: Family) -> None:
    """Raise unless `fam`'s config.json can say every option of `cfg` (transformers would build another model)."""
    bias_ok = {"config": cfg.qkv_bias == cfg.o_bias, "qkv": cfg.qkv_bias and not cfg.o_bias,
               "none": not (cfg.qkv_bias or cfg.o_bias)}[fam.attention_bias]
    problems = [what for what, ok in (
        (f"q/k/v bias {cfg.qkv_bias} with o bias {cfg.o_bias}", bias_ok),
        ("mlp_bias", fam.reads_mlp_bias or not cfg.mlp_bias),
        (f"qk_norm {cfg.qk_norm}", cfg.qk_norm == fam.qk_norm),
        (f"rope_type {cfg.rope_scaling.rope_type}", cfg.rope_scaling.rope_type in fam.rope_types),
        ("a sliding window", fam.sliding_window != "none" or cfg.sliding_window is None),
        ("per-layer windows", fam.sliding_window == "layer_types" or cfg.layer_types is None),
        ("experts" if cfg.is_moe else "a dense MLP", cfg.is_moe == fam.experts),
    ) if not ok]
    if problems:
        raise HflowError(f"a {fam.name} config.json cannot hold {', '.join(problems)}; pick the family whose "
                         f"options these are ({', '.join(FAMILIES)})")


def hf_config(cfg: DecoderConfig, head: Head = "lm", dtype: str = "float32") -> dict[str, Any]:
    """A `config.json` mapping transformers (4.x and 5.x) builds the same model from."""
    fam = family(cfg.family)
    _representable(cfg, fam)
    rope = {"rope_type": cfg.rope_scaling.rope_type, "rope_theta": cfg.rope_theta} | cfg.rope_scaling.model_dump(
        exclude={"rope_type"}, exclude_none=True, exclude_defaults=cfg.rope_scaling.rope_type == "default")
    d: dict[str, Any] = dict(
        architectures=[fam.architecture(head)], model_type=fam.model_types[0], hidden_act="silu",
        **cfg.model_dump(include={"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                  "max_position_embeddings", "tie_word_embeddings", "initializer_range"}),
        head_dim=cfg.dim_head, rope_theta=cfg.rope_theta, rope_parameters=rope,
        torch_dtype=dtype, dtype=dtype, attention_dropout=0.0, use_cache=True,
    )
    if fam.attention_bias == "config":
        d["attention_bias"] = cfg.qkv_bias
    if fam.reads_mlp_bias:
        d["mlp_bias"] = cfg.mlp_bias
    if fam.sliding_window == "all_layers":
        d["sliding_window"] = cfg.sliding_window
    elif fam.sliding_window == "layer_types":
        d.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                 layer_types=[("full_attention" if cfg.attention_window(i) is None else "sliding_attention")
                              for i in range(cfg.num_hidden_layers)])
    if fam.experts:
        d.update(num_local_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 router_jitter_noise=0.0, output_router_logits=False)
    if head == "scalar":
        d.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return d


def tensor_shapes(cfg: DecoderConfig, head: Head = "lm") -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this model holds, by name (Llama's names; Mixtral's
    for its experts). A tied LM head is not listed (checkpoints omit it); nor is our score bias (HF's
    `score` has none): both are optional on reading."""
    h, d, f = cfg.hidden_size, cfg.dim_head, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q)}
        if cfg.qkv_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if cfg.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        if cfg.is_moe:
            layer["block_sparse_moe.gate.weight"] = (cfg.num_local_experts, h)
            for e in range(cfg.num_local_experts):
                x = f"block_sparse_moe.experts.{e}."
                layer |= {x + "w1.weight": (f, h), x + "w2.weight": (h, f), x + "w3.weight": (f, h)}
        else:
            layer |= {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
        if cfg.mlp_bias:
            layer |= {"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)}
        layer |= {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        out |= {p + k: v for k, v in layer.items()}
    out["model.norm.weight"] = (h,)
    if head == "scalar":
        out["score.weight"] = (1, h)
    elif not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out
