"""What both training engines (FSDP2: training.py, Megatron: megatron_training.py) share: the optimiser
settings, the loss function's signature, token statistics from logits, the first logit a responses-only
pass needs, batches as TensorDicts, and gradient clipping over DTensor meshes."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.train.packing import Packed

LossFn = Callable[[dict, TensorDict], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"]


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: PositiveFloat = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0  # 0 turns clipping off
    warmup_steps: int = Field(0, ge=0)  # linear warm-up of the learning rate
    # A step whose gradient norm (or loss) is not finite is skipped; this many in a row stop the run.
    max_skipped_steps: PositiveInt = 3


# ---- token statistics from logits ---------------------------------------------------------------


def picked_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] for logits [..., V] and targets [...] (fp32): the chosen logit minus the
    logsumexp, so no [..., V] log-softmax is kept for the backward (it recomputes the softmax from the
    logits it already holds)."""
    logits = logits.float()
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension (fp32)."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (F.softmax(logits, -1) * logits).sum(-1)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """log p(input_ids[:, i] | < i) from logits [B, S - start, V] of positions start…S-1; [B, S] with
    positions ≤ start = 0 (fp32)."""
    return F.pad(picked_log_probs(logits[:, :-1], input_ids[:, start + 1:]), (start + 1, 0))


def token_entropy(logits: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Entropy of each predictive distribution, aligned like token_log_probs: [B, S] (fp32)."""
    return F.pad(entropy_of(logits[:, :-1]), (start + 1, 0))


def first_scored_logit(width: int, score_width: int | None, packed: Packed | None) -> int:
    """The first position whose logits a forward over `width` columns needs when only the caller's last
    `score_width` columns are read (each column's log-prob comes from the logits one position before)."""
    if not score_width:
        return 0
    if packed is None:
        return max(width - score_width - 1, 0)
    caller = packed.source.shape[1]
    return max(int(packed.source[:, max(caller - score_width, 0)].min()) - 1, 0)


def as_tensordict(batch: Mapping[str, torch.Tensor] | TensorDict) -> TensorDict:
    if isinstance(batch, TensorDict):
        return batch
    if hasattr(batch, "tensors") and isinstance(batch.tensors, TensorDict):  # runtime.batch.Batch
        return batch.tensors
    n = next(iter(batch.values())).shape[0]
    return TensorDict(dict(batch), batch_size=[n])


# ---- gradient clipping over mixed DTensor meshes ------------------------------------------------


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global 2-norm; correct for plain, TP (DTensor) and FSDP+TP (2-D DTensor) grads.

    Gradients are grouped by (mesh, placements) because one norm cannot mix meshes; each group's
    norm is made whole with `full_tensor()`, and plain (replicated) grads count once.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None].append(g)
    total_sq = 0.0
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        total_sq += float(n) ** 2
    total = math.sqrt(total_sq)
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for grads in groups.values():
            for g in grads:
                g.mul_(coef)
    return total
