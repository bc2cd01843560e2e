"""PhaseClock: seconds and work spent in each phase of an engine's op, summed until taken.

The Timeline records an op (generate, actor_update…) as one span; the step breakdown
(tools/bench/step_breakdown.py) splits it further — generation into weight fusion, prefill, decode
and sampling; a training step into forward, backward and optimizer — and counts the work of each
phase (tokens computed, attention context) so that it can put achieved FLOP/s beside the roofline.

Off by default, and then free (one attribute check per phase). On, a GPU is synchronised at each
phase's edges so that its seconds are the phase's own (that costs a little: turn it on to measure).

    clock.enabled = True
    with clock.span("forward"):
        clock.count("tokens", n)        # counted as "forward.tokens"
    clock.take()                        # {"forward": seconds, "forward.tokens": n}; then zeroed
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

_OFF = nullcontext()  # what span() returns while off: stateless, so one serves every call


class PhaseClock:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._sums: dict[str, float] = defaultdict(float)
        self._open: list[str] = []  # the phases we are in, innermost last: counts go to the innermost

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def span(self, phase: str):
        """Time the `with` block as `phase` (off: a shared no-op context, nothing allocated per call)."""
        return self._timed(phase) if self.enabled else _OFF

    @contextmanager
    def _timed(self, phase: str):
        self._sync()
        self._open.append(phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._sums[phase] += time.perf_counter() - start
            self._open.pop()

    def count(self, what: str, amount: float) -> None:
        """Add `amount` of work `what` to the innermost open phase (nothing when off or outside a phase)."""
        if self.enabled and self._open:
            self._sums[f"{self._open[-1]}.{what}"] += float(amount)

    def count_pass(self, rows: int, width: int, real_tokens: float) -> None:
        """The work of one causal pass over `rows` rows of `width` (padded or packed) tokens: tokens computed,
        the real ones among them, and the attention context (each position attends to those up to it)."""
        if self.enabled and self._open:
            self.count("tokens", rows * width)
            self.count("real_tokens", real_tokens)
            self.count("context", rows * width * (width + 1) / 2)

    def take(self) -> dict[str, float]:
        """Everything summed since the last take (seconds by phase, work as 'phase.what'), then zeroed."""
        out, self._sums = dict(self._sums), defaultdict(float)
        return out
