"""Masked reductions over response tokens (mask = 1 on response tokens, 0 on padding)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Token-mean: the sum over unmasked tokens divided by their count (0 when there are none)."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    n = m.sum()
    var = masked_sum((x - mean) ** 2, m)
    denom = n - 1 if unbiased and n > 1 else n.clamp(min=1.0)
    return var / denom


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over unmasked tokens (unbiased variance); zero on padding."""
    m = mask.to(x.dtype)
    return (x - masked_mean(x, m)) * torch.rsqrt(masked_var(x, m) + eps) * m
