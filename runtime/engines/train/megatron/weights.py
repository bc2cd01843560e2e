"""Weights between the Hugging Face layout (our decoder's names) and megatron-core's GPTModel.

Megatron fuses what HF keeps apart, and tensor parallelism splits each fused tensor along its
partition dim:

- `linear_qkv` is q, k and v grouped per query group: for each of the `G` kv heads, its
  heads/G query heads, then its key head, then its value head ([q × heads/G, k, v] × G rows), so a
  column shard over tp holds whole groups;
- `linear_fc1` is [gate; up]; a column shard holds [gate shard; up shard] (partition stride 2);
- `linear_proj` and `linear_fc2` (o_proj, down_proj) are split along their input dim (row
  parallel), embeddings and the LM head along the vocabulary; norms and row-parallel biases are
  replicated;
- a MoE layer (Mixtral): the router `block_sparse_moe.gate` is `mlp.router`, replicated; expert e's
  w1, w3 (gate, up) are its `linear_fc1` = [w1; w3] and w2 its `linear_fc2`, under
  `mlp.experts.local_experts.{e}`. Experts are not split over tp (expert tensor parallel size 1, as
  the FSDP engine keeps them whole); expert parallelism gives each ep rank a contiguous block of them,
  renumbered from 0 there (`to_local_expert`);
- tied embeddings: no `output_layer` where the model has one stage (the last pipeline stage
  keeps a copy Megatron keeps equal); the scalar head (`score`) is `output_layer`, replicated.

Pure tensor code (no megatron import): the conversions are exact permutations and concatenations.
Layer and expert indices are global here; a pipeline stage renumbers its layers, an ep rank its experts.
"""

from __future__ import annotations

import re

import torch

from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig

_LAYER = re.compile(r"^(model\.layers|decoder\.layers)\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MG_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# HF name inside a layer -> megatron name inside a layer (one-to-one tensors).
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.down_proj.bias": "mlp.linear_fc2.bias",
    "block_sparse_moe.gate.weight": "mlp.router.weight",
}
_TOP_SIMPLE = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
    "score.weight": "output_layer.weight",
    "score.bias": "output_layer.bias",
}
_REPLICATED_SUFFIXES = ("layernorm.weight", "linear_proj.bias", "linear_fc2.bias", "router.weight")


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: DecoderConfig, tp: int) -> torch.Tensor:
    g, d = cfg.num_key_value_heads // tp, cfg.dim_head
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    per_group = cfg.num_attention_heads // cfg.num_key_value_heads * d
    return torch.cat([q.reshape(g, per_group, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1) \
        .reshape(-1, *rest)


def _qkv_split(qkv: torch.Tensor, cfg: DecoderConfig, tp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = cfg.num_key_value_heads // tp, cfg.dim_head
    rest = qkv.shape[1:]
    per_group = cfg.num_attention_heads // cfg.num_key_value_heads * d
    q, k, v = qkv.reshape(g, per_group + 2 * d, *rest).split([per_group, d, d], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: DecoderConfig, tp: int = 1) -> dict[str, torch.Tensor]:
    """HF tensors -> megatron tensors (global layer numbers): whole ones, or with `tp` > 1 one tensor-
    parallel rank's shards of each (an HF column shard of q, k, v holds whole query groups)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        m = _LAYER.match(name)
        if m is None:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # the head is the embedding
            out[_TOP_SIMPLE[name]] = t
            continue
        i, rest = m.group(2), m.group(3)
        prefix = f"decoder.layers.{i}."
        if rest in _LAYER_SIMPLE:
            out[prefix + _LAYER_SIMPLE[rest]] = t
        elif rest.startswith("self_attn.q_proj."):
            kind = rest.rsplit(".", 1)[1]
            p = f"model.layers.{i}.self_attn."
            out[f"{prefix}self_attention.linear_qkv.{kind}"] = _qkv_fuse(
                hf[f"{p}q_proj.{kind}"], hf[f"{p}k_proj.{kind}"], hf[f"{p}v_proj.{kind}"], cfg, tp)
        elif (e := _HF_EXPERT.match(rest)) is not None:
            x = f"model.layers.{i}.block_sparse_moe.experts.{e.group(1)}."
            local = f"{prefix}mlp.experts.local_experts.{e.group(1)}."
            if e.group(2) == "w1":
                out[local + "linear_fc1.weight"] = torch.cat([hf[x + "w1.weight"], hf[x + "w3.weight"]])
            elif e.group(2) == "w2":
                out[local + "linear_fc2.weight"] = t
        elif rest.startswith("mlp.gate_proj."):
            kind = rest.rsplit(".", 1)[1]
            p = f"model.layers.{i}.mlp."
            out[f"{prefix}mlp.linear_fc1.{kind}"] = torch.cat([hf[f"{p}gate_proj.{kind}"], hf[f"{p}up_proj.{kind}"]])
        elif not rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.", "mlp.up_proj.")):
            raise KeyError(f"no megatron name for {name}")
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], cfg: DecoderConfig, head: str = "lm",
                   tp: int = 1) -> dict[str, torch.Tensor]:
    """Megatron tensors (global layer numbers) -> HF tensors; the inverse of hf_to_megatron (`tp` > 1:
    one rank's shards to HF-named shards, split along `hf_tp_dim`)."""
    top = {v: k for k, v in _TOP_SIMPLE.items() if k.startswith("score" if head == "scalar" else ("model", "lm"))}
    top |= {v: k for k, v in _TOP_SIMPLE.items() if k.startswith("model")}
    layer = {v: k for k, v in _LAYER_SIMPLE.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in mg.items():
        m = _LAYER.match(name)
        if m is None:
            out[top[name]] = t
            continue
        i, rest = m.group(2), m.group(3)
        prefix = f"model.layers.{i}."
        if rest in layer:
            out[prefix + layer[rest]] = t
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), _qkv_split(t, cfg, tp), strict=True):
                out[f"{prefix}self_attn.{proj}.{kind}"] = part.contiguous()
        elif (e := _MG_EXPERT.match(name)) is not None:
            x = f"{prefix}block_sparse_moe.experts.{e.group(2)}."
            if e.group(3) == "linear_fc1":
                w1, w3 = t.chunk(2)
                out[x + "w1.weight"], out[x + "w3.weight"] = w1.contiguous(), w3.contiguous()
            else:
                out[x + "w2.weight"] = t
        elif rest.startswith("mlp.linear_fc1."):
            kind = rest.rsplit(".", 1)[1]
            gate, up = t.chunk(2)
            out[f"{prefix}mlp.gate_proj.{kind}"], out[f"{prefix}mlp.up_proj.{kind}"] = gate.contiguous(), up.contiguous()
        else:
            raise KeyError(f"no HF name for {name}")
    if head == "lm" and cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---- tensor-parallel shards ---------------------------------------------------------------------


def partition(name: str) -> tuple[int | None, int]:
    """(partition dim, stride) of a megatron parameter under tensor parallelism (None: replicated)."""
    if name.endswith(_REPLICATED_SUFFIXES) or name.startswith("output_layer.") and name.endswith("bias"):
        return None, 1
    if is_expert(name):  # whole on every tp rank (expert tensor parallel size 1)
        return None, 1
    if "linear_fc1." in name:
        return 0, 2
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    return 0, 1


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp: int, scalar_head: bool = False) -> torch.Tensor:
    """This tp rank's shard of a whole megatron tensor."""
    dim, stride = partition(name)
    if dim is None or tp == 1 or (scalar_head and name.startswith("output_layer.")):
        return full
    parts = full.chunk(stride, dim)  # fc1: gate and up, each split over tp
    return torch.cat([p.chunk(tp, dim)[tp_rank] for p in parts], dim).contiguous()


def tp_unshard(name: str, shards: list[torch.Tensor], scalar_head: bool = False) -> torch.Tensor:
    """The whole megatron tensor from the shards of every tp rank, in rank order."""
    dim, stride = partition(name)
    if dim is None or len(shards) == 1 or (scalar_head and name.startswith("output_layer.")):
        return shards[0]
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in pieces], dim) for j in range(stride)], dim)


def hf_tp_dim(name: str, tied: bool = False) -> int | None:
    """The dim of an HF-named tensor a megatron tp rank holds a shard of (None: whole); with tied
    embeddings the embedding is reported whole (gathered), as the FSDP engine's TP plan keeps it."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return None if tied else 0
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
                      "gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias")):
        return 0
    return 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else None


# ---- pipeline stages ------------------------------------------------------------------------------


def stage_layers(cfg: DecoderConfig, pp_rank: int, pp: int) -> range:
    """Global indices of the decoder layers a pipeline stage holds (Megatron's even split)."""
    per = cfg.num_hidden_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def to_local_layer(name: str, offset: int) -> str:
    """A global layer name renumbered as the stage's own (`decoder.layers.{i - offset}`)."""
    m = _LAYER.match(name)
    return name if m is None else f"{m.group(1)}.{int(m.group(2)) - offset}.{m.group(3)}"


def is_expert(name: str) -> bool:
    """A megatron tensor of one expert (held by one ep rank)."""
    return _MG_EXPERT.match(name) is not None


def to_local_expert(name: str, offset: int) -> str:
    """An expert's tensor renumbered by `-offset` (global -> an ep rank's own with its first expert's
    index; local -> global with minus that)."""
    m = _MG_EXPERT.match(name)
    return name if m is None else f"{m.group(1)}{int(m.group(2)) - offset}.{m.group(3)}.weight"


def layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return None if m is None else int(m.group(2))
