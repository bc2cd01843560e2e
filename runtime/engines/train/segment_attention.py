"""Attention confined to each packed sequence (varlen attention): the attention core (`Attention.core`,
models/decoder.py) of a forward over sequences packed back to back in one row (packing.py `SequencePack`).

`SegmentAttention` wraps the core it replaces. Outside `segments(cu_seqlens)` it is that core; inside, each
query attends causally to the keys of its own sequence only (and, with a sliding window, to those fewer than
`window` positions back), which is exactly what it sees in its own padded row. On CUDA with flash-attn
installed and half-precision inputs this is `flash_attn_varlen_func`; otherwise one scaled-dot-product
attention per sequence: its cost is Σ L² over the sequences, not T² over the packed row, and it needs no
[T, T] mask. The decoder's own mask (None for plain causal attention, a window mask) is ignored inside.
Under Ulysses sequence parallelism the wrapped core runs after the all-to-all, on the whole sequence
(fsdp/ulysses.py), so the same boundaries hold there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hybridflow.runtime.models.decoder import Attention, attention_bias_mask, sdpa_attention

try:  # flash-attn's varlen kernel, where installed (GPU images); the per-sequence loop otherwise
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the image
    flash_attn_varlen_func = None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     window: int | None = None) -> torch.Tensor:
    """Causal attention of q [1, h, T, d] over k/v [1, kv_h, T, d] within each sequence cu[j] .. cu[j+1]-1."""
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
        out = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                                     longest, longest, causal=True,
                                     window_size=(-1, -1) if window is None else (window - 1, 0))
        return out.transpose(0, 1)[None]
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    parts = []
    # split, not a slice per sequence: one backward node concatenates the gradients, where each slice's
    # backward would write a whole [1, h, T, d] gradient of zeros
    for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True):
        n = qs.shape[2]
        mask = None  # plain causal within the sequence
        if window is not None and n > window:
            mask = attention_bias_mask(torch.ones(1, n, dtype=torch.bool, device=q.device), n, 0, window)
        parts.append(sdpa_attention(qs, ks, vs, mask))
    return torch.cat(parts, dim=2)


class SegmentAttention:
    """An attention core: the wrapped one, or inside `segments(cu)` attention per packed sequence."""

    def __init__(self, inner=sdpa_attention):
        self.inner = inner
        self.cu_seqlens: list[int] | None = None

    @contextmanager
    def segments(self, cu_seqlens: list[int]) -> Iterator[None]:
        self.cu_seqlens = cu_seqlens
        try:
            yield
        finally:
            self.cu_seqlens = None

    def __call__(self, q, k, v, mask, window=None):
        if self.cu_seqlens is None:
            return self.inner(q, k, v, mask, window)
        if q.shape[0] != 1 or q.shape[2] != self.cu_seqlens[-1]:
            raise ValueError(f"packed attention expects one row of {self.cu_seqlens[-1]} positions, got {q.shape}")
        return varlen_attention(q, k, v, self.cu_seqlens, window)


def install_segment_attention(model: nn.Module) -> SegmentAttention:
    """Wrap every attention layer's core (one shared SegmentAttention: the layers share one core today)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    cores = {id(m.core) for m in layers}
    if len(cores) != 1:
        raise ValueError("sequence packing expects one attention core shared by every layer")
    core = SegmentAttention(layers[0].core)
    for m in layers:
        m.core = core
    return core
