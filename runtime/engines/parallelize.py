"""Apply a ParallelConfig to a model from the outside (TorchTitan style).

The model file knows nothing of parallelism; this file shards it:

- tensor parallelism with DTensor's `parallelize_module`, as the model family's plan
  (simulator/vocabulary/families.py) names the modules: q/k/v and gate/up column-wise, o/down row-wise (one
  all-reduce after attention and one after the MLP); per-head q/k norms (Qwen3) see only the local
  heads, so their replicated weights are DTensors whose gradients are summed over tp; the embedding
  is split along the vocabulary (row-wise, output replicated) and the LM head column-wise with
  replicated logits, so every tensor-parallel rank sees the full logits for log-probs and entropy.
  Other norms and the scalar head `score` stay replicated (they are tiny). A tied LM head keeps
  embedding and head replicated. A layer that LoRA wraps (engines/train/lora.py: peft's layer holding
  `base_layer`, `lora_A`, `lora_B`) is split as its base layer is, with its adapters alongside: under a
  column-wise layer B is column-wise and A replicated, under a row-wise layer A is row-wise (its output
  all-reduced) and B replicated; either way the adapter's output is laid out as the base layer's.
- data parallelism with FSDP2 `fully_shard` over the `dp` mesh dimension, per decoder layer then
  the root; with TP this gives 2-D (dp × tp) DTensor parameters.
- pipeline parallelism: pipeline.py first cuts the model into this rank's stage (contiguous
  layers; embeddings on the first stage, final norm and head on the last); TP and FSDP then apply
  to the stage exactly as to a whole model, over the stage's own ("dp", "tp") sub-meshes.

Device mesh dims are ("pp", "dp", "tp") in the simulator's rank order (tp fastest), so a
tensor-parallel group is consecutive ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.families import TensorParallelPlan, family
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(cfg: ParallelConfig, device: str | None = None) -> DeviceMesh:
    """A ("pp", "dp", "tp") mesh over all ranks of the default process group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if cfg.world_size != world:
        raise HflowError(f"parallel config {cfg} needs {cfg.world_size} processes but the group has {world}; "
                         "start as many workers as pp·tp·dp")
    return init_device_mesh(device or device_type(), (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (a pipeline stage keeps its own in a ModuleDict keyed by global index)."""
    try:
        return model.model.decoder_layers()
    except AttributeError:
        raise HflowError(f"{type(model).__name__} has no decoder layers; parallelize expects a model of "
                         "runtime/models/decoder.py") from None


def _tp_plan(model: nn.Module) -> TensorParallelPlan:
    return family(model.config.family).tp_plan


def _is_tied(model: nn.Module) -> bool:
    head, embed = getattr(model, "lm_head", None), model.model.embed_tokens
    return head is not None and embed is not None and head.weight is embed.weight


def check_tp(model: nn.Module, tp: int) -> None:
    cfg = model.config
    bad = []
    if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
        bad.append(f"heads {cfg.num_attention_heads}/kv_heads {cfg.num_key_value_heads}")
    if cfg.intermediate_size % tp:
        bad.append(f"intermediate_size {cfg.intermediate_size}")
    if not _is_tied(model) and cfg.vocab_size % tp:
        bad.append(f"vocab_size {cfg.vocab_size}")
    if bad:
        raise HflowError(f"tp={tp} must divide {', '.join(bad)}; pick a tensor-parallel size that divides them")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place over the 1-D mesh `tp_mesh` (see the module docstring for the plan)."""
    check_tp(model, tp_mesh.size())
    tp = _tp_plan(model)
    # A head norm gets [b, s, local heads, head_dim]: its input is sharded on dim 2 (the heads).
    plan = ({name: ColwiseParallel() for name in tp.colwise} | {name: RowwiseParallel() for name in tp.rowwise}
            | {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in tp.head_norms})
    for layer in _layers(model):
        parallelize_module(layer, tp_mesh, _with_adapters(layer, {k: v for k, v in plan.items() if _has(layer, k)}))
    if hasattr(model, "lm_head") and not _is_tied(model):  # a pipeline stage may hold either or neither
        for name in tp.vocab:
            module = _get(model, name)
            if isinstance(module, nn.Embedding):  # vocabulary rows split, output summed and replicated
                parallelize_module(module, tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                                    output_layouts=Replicate()))
            elif module is not None:  # the LM head's vocabulary columns split, logits gathered
                parallelize_module(module, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    return model


def _with_adapters(layer: nn.Module, plan: dict) -> dict:
    """`plan` with each LoRA-wrapped layer's entry moved onto its base layer and its split adapter."""
    out = {}
    for name, style in plan.items():
        module = _get(layer, name)
        if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        for adapter in module.lora_A:  # peft's adapters by name ("default")
            if isinstance(style, ColwiseParallel):
                out[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            else:
                out[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
    return out


def _get(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule at dotted path `name`, or None where a pipeline stage dropped it (or a part of it)."""
    for part in name.split("."):
        model = getattr(model, part, None)
        if model is None:
            return None
    return model


def _has(module: nn.Module, name: str) -> bool:
    return _get(module, name) is not None


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 per decoder layer, then the root (embeddings, final norm, head)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kw = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in _layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def resolve_mixed_precision(mesh: DeviceMesh, requested: bool | None) -> bool:
    """bf16 compute with fp32 master weights: as requested, by default on CUDA only."""
    return mesh.device_type == "cuda" if requested is None else requested


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, *, mixed_precision: bool | None = None,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (fp32, on its device; under pp > 1 this rank's stage, see pipeline.py) as
    `cfg` says over `mesh` = build_mesh(cfg).

    `mixed_precision`: bf16 parameters in compute with fp32 master weights and gradient reduction
    (FSDP2's MixedPrecisionPolicy); default on for CUDA, off (pure fp32) on CPU.
    """
    mixed_precision = resolve_mixed_precision(mesh, mixed_precision)
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"])
    if cfg.dp > 1 or mixed_precision:
        apply_fsdp(model, mesh["dp"], torch.bfloat16 if mixed_precision else None, reshard_after_forward)
    return model


def tp_plan_dims(model: nn.Module) -> dict[str, int | None]:
    """For every parameter, the dimension `apply_tp` splits it along (None: replicated), whatever
    the tensor-parallel size: the 3D-HybridEngine's view of a whole model across pipeline stages."""
    tied, tp = _is_tied(model), _tp_plan(model)
    dims = {}
    for name, _ in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if any(module.endswith(c) for c in tp.colwise):
            dims[name] = 0
        elif any(module.endswith(r) for r in tp.rowwise):
            dims[name] = 1 if kind == "weight" else None  # RowwiseParallel replicates the bias
        elif module in tp.vocab and not tied:
            dims[name] = 0
        else:
            dims[name] = None
    return dims


def tp_shard_dim(param: torch.Tensor, tp_mesh_dim: str = "tp") -> int | None:
    """The tensor dimension a parameter is split along over the tp mesh dim (None: replicated)."""
    if not isinstance(param, DTensor):
        return None
    names = param.device_mesh.mesh_dim_names or ()
    if tp_mesh_dim not in names:
        return None
    placement = param.placements[names.index(tp_mesh_dim)]
    return placement.dim if isinstance(placement, Shard) else None


def tp_local(param: torch.Tensor, tp_mesh_dim: str = "tp") -> torch.Tensor:
    """This rank's tensor-parallel shard of a parameter, gathered over any other mesh dims (dp).

    For FSDP2 + TP parameters this all-gathers over dp only; for TP-only DTensors it is the local
    tensor (no communication); plain tensors are returned as they are.
    """
    if not isinstance(param, DTensor):
        return param
    names = param.device_mesh.mesh_dim_names or ()
    placements = [p if names[i] == tp_mesh_dim else Replicate() for i, p in enumerate(param.placements)]
    if list(placements) != list(param.placements):
        param = param.redistribute(param.device_mesh, placements)
    return param.to_local()


def load_tp_local(param: torch.Tensor, local: torch.Tensor, tp_mesh_dim: str = "tp") -> None:
    """Write this rank's tensor-parallel shard `local` back into `param` (inverse of tp_local)."""
    with torch.no_grad():
        if not isinstance(param, DTensor):
            param.copy_(local)
            return
        names = param.device_mesh.mesh_dim_names or ()
        placements = [p if names[i] == tp_mesh_dim else Replicate() for i, p in enumerate(param.placements)]
        full = DTensor.from_local(local, param.device_mesh, placements, run_check=False)
        # Replicate -> Shard on the dp dims is a local slice: no communication.
        param.to_local().copy_(full.redistribute(param.device_mesh, param.placements).to_local())
