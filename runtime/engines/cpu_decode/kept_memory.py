"""CPU memory the generation engine keeps from one `generate()` call to the next: fast_decode.py's
KV cache and packed weights (the C kernels' operands).

A large fresh allocation is fresh pages every time — a page fault and a zeroed 4 KB page for each
page its first write touches: for a model's packed weights that took longer than the packing.
Kept memory is faulted in once. It is also asked for transparent huge pages (madvise; the OS may
decline), so a decode step that streams every weight and the cache walks a few 2 MB pages instead
of thousands of 4 KB ones. One call at a time uses it: an engine's calls do not overlap.
"""

from __future__ import annotations

import math
import mmap

import torch

ALIGN = 16  # floats: each weight starts on a 64-byte line


def _block(numel: int) -> torch.Tensor:
    """`numel` fp32 of fresh anonymous memory, huge pages asked for where the OS has them."""
    memory = mmap.mmap(-1, max(numel, 1) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no huge pages
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.float32)  # the tensor keeps the mapping alive


class KeptMemory:
    """The KV cache's block (the largest asked for so far) and the packed weights' block: weights
    take it one after another from the start at each call (`restart`); what does not fit (the first
    call, a bigger model) is allocated apart, and the block grows to the whole at the next call."""

    def __init__(self):
        self._cache: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._offset = self._asked = 0

    def cache(self, numel: int) -> torch.Tensor:
        if self._cache is None or self._cache.numel() < numel:
            self._cache = None  # the old block goes before the new one is allocated
            self._cache = _block(numel)
        return self._cache[:numel]

    def restart(self) -> None:
        """A new call's weights: from the block's start, the block grown first to what the last call asked."""
        if self._asked > (0 if self._weights is None else self._weights.numel()):
            self._weights = None
            self._weights = _block(self._asked)
        self._offset = self._asked = 0

    def empty(self, *shape: int) -> torch.Tensor:
        """fp32 memory for a weight of `shape`, after this call's others."""
        numel = math.prod(shape)
        span = -(-numel // ALIGN) * ALIGN
        self._asked += span
        if self._weights is None or self._offset + numel > self._weights.numel():
            return torch.empty(shape)
        self._offset += span
        return self._weights[self._offset - span:self._offset - span + numel].view(shape)
