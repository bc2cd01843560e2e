"""Gradient clipping over the mixed DTensor meshes of an FSDP2 + tensor-parallel model."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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
