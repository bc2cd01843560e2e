"""Masked reductions over response tokens (mask = 1 on response tokens, 0 on padding).

Masking selects with `torch.where`, never multiplies: a NaN or inf at a padded position (a
log-ratio of padding, say) would survive `x * 0` and poison the sum.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x on unmasked positions, 0 elsewhere (whatever x holds there)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    z = masked(x, mask)
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Token-mean: the sum over unmasked tokens divided by their count (0 when there are none)."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    mean = masked_mean(x, mask)
    n = mask.to(x.dtype).sum()
    var = masked_sum((x - mean) ** 2, mask)
    denom = n - 1 if unbiased and n > 1 else n.clamp(min=1.0)
    return var / denom


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over unmasked tokens (unbiased variance); zero on padding."""
    return masked((x - masked_mean(x, mask)) * torch.rsqrt(masked_var(x, mask) + eps), mask)
