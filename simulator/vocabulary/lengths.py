"""Response lengths as a distribution (reasoning RL's long tail), not one fixed length.

Given as quantiles (cumulative share → length, the share 1.0 being the longest response), as a
histogram (bin upper edges and counts) or as observed lengths (a run's metrics); kept as quantiles
and read through the piecewise-linear quantile function between them. Pricing draws a batch's
lengths deterministically from it (`sample`: the quantile function at evenly spaced shares), so a
price never depends on a random seed, and uses its moments where only sums matter (packed tokens,
per-sequence attention).
"""

from __future__ import annotations

import bisect
from functools import cached_property

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

# The quantiles a run records per iteration (metrics "response_lengths"), by the share each names.
RECORDED_QUANTILES = {"min": 0.0, "p10": 0.1, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p90": 0.9, "p99": 0.99,
                      "max": 1.0}


MAX_ENTROPY_SHARES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 0.9999, 0.99999)


def _linear_moment(xs, ys, k: int) -> float:
    """E[L^k] of the quantile function through the knots (xs: shares, ys: lengths), linear between them
    (exact per linear piece)."""
    total = 0.0
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False):
        if x1 == x0:
            continue
        if y1 == y0:
            total += (x1 - x0) * y0**k
        else:  # ∫ y^k du with y linear in u
            total += (x1 - x0) * (y1 ** (k + 1) - y0 ** (k + 1)) / ((k + 1) * (y1 - y0))
    return total


class LengthDistribution(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    quantiles: dict[float, PositiveInt]  # cumulative share (0 ≤ q ≤ 1; 0 the shortest, 1.0 required: the longest) → length

    @model_validator(mode="before")
    @classmethod
    def _other_forms(cls, data):
        """`histogram: {lengths: [...upper edges], counts: [...]}`, `observed: [lengths...]` or `{mean: M, max: L}`
        (max_entropy) → quantiles."""
        if not isinstance(data, dict) or "quantiles" in data:
            return data
        if set(data) == {"mean", "max"}:
            return {"quantiles": cls.max_entropy(float(data["mean"]), int(data["max"])).quantiles}
        if set(data) == {"histogram"}:
            h = data["histogram"] or {}
            edges, counts = list(h.get("lengths", [])), list(h.get("counts", []))
            if not edges or len(edges) != len(counts) or edges != sorted(edges) or any(c < 0 for c in counts) \
                    or sum(counts) <= 0:
                raise ValueError("a histogram needs ascending `lengths` (bin upper edges) and as many non-negative "
                                 "`counts`, not all zero")
            total, acc, q = float(sum(counts)), 0.0, {}
            for edge, c in zip(edges, counts, strict=True):
                acc += c
                if c > 0:
                    q[min(acc / total, 1.0)] = int(edge)
            q[1.0] = int(edges[max(i for i, c in enumerate(counts) if c > 0)])
            return {"quantiles": q}
        if set(data) == {"observed"}:
            obs = sorted(int(x) for x in data["observed"] or [])
            if not obs or obs[0] < 1:
                raise ValueError("`observed` needs at least one length, each at least 1 token")
            n = len(obs)  # each observation at the middle of its share, the extremes at 0 and 1
            return {"quantiles": {0.0: obs[0], **{(i + 0.5) / n: v for i, v in enumerate(obs)}, 1.0: obs[-1]}}
        return data

    @model_validator(mode="after")
    def _check(self):
        if not self.quantiles:
            raise ValueError("give at least the longest response: quantiles {1.0: LENGTH}")
        qs = sorted(self.quantiles)
        if qs[0] < 0.0 or qs[-1] != 1.0:
            raise ValueError(f"quantile shares must lie in [0, 1] and include 1.0 (the longest), got {qs}")
        lengths = [self.quantiles[q] for q in qs]
        if lengths != sorted(lengths):
            raise ValueError(f"lengths must not decrease with the share: {dict(zip(qs, lengths, strict=True))}")
        return self

    def __hash__(self) -> int:  # a Workload holding one is a memo key
        return hash(tuple(sorted(self.quantiles.items())))

    @classmethod
    def from_recorded(cls, records: list[dict]) -> LengthDistribution:
        """From a run's per-iteration quantiles (RECORDED_QUANTILES), each the mean over `records`: the
        lengths the policy produced lately."""
        if not records:
            raise ValueError("no iteration recorded response lengths")
        q = {share: max(1, round(sum(r[k] for r in records) / len(records))) for k, share in RECORDED_QUANTILES.items()}
        shares = sorted(q)
        for lo, hi in zip(shares, shares[1:], strict=False):  # means of quantiles keep their order; rounding too
            q[hi] = max(q[hi], q[lo])
        return cls(quantiles=q)

    @classmethod
    def max_entropy(cls, mean: float, longest: int, shortest: int = 1) -> LengthDistribution:
        """The least-assuming lengths with a known mean and maximum: the maximum-entropy distribution on
        [shortest, longest] with that mean (a truncated exponential, decreasing below the midpoint, increasing
        above it), kept as its quantiles."""
        import math

        from scipy.optimize import brentq

        lo, hi = float(shortest), float(longest)
        if not lo < mean < hi:
            raise ValueError(f"a mean of {mean:g} must lie strictly between the shortest ({shortest}) and the longest "
                             f"({longest}) response")
        span = hi - lo  # the density ∝ exp(-lam·(x - lo)) on [lo, hi]

        def quantile(lam: float, u: float) -> float:
            if u <= 0.0 or u >= 1.0:
                return lo if u <= 0.0 else hi
            if abs(lam * span) < 1e-9:
                return lo + u * span
            return lo - math.log1p(-u * -math.expm1(-lam * span)) / lam

        shares = (0.0, *MAX_ENTROPY_SHARES, 1.0)

        def kept_mean(lam: float) -> float:  # the mean of the quantiles kept, read linearly between them
            return _linear_moment(shares, [quantile(lam, u) for u in shares], 1)

        bound = 700.0 / span  # keeps exp() finite
        if not kept_mean(bound) < mean < kept_mean(-bound):
            raise ValueError(f"a mean of {mean:g} is too close to the shortest or the longest ({longest}) response for "
                             "this form; give quantiles instead")
        lam = brentq(lambda x: kept_mean(x) - mean, -bound, bound)
        q = {u: max(1, round(quantile(lam, u))) for u in MAX_ENTROPY_SHARES}
        q[0.0], q[1.0] = shortest, longest
        return cls(quantiles=q)

    @classmethod
    def fixed(cls, length: int) -> LengthDistribution:
        return cls(quantiles={1.0: length})

    @cached_property
    def _knots(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The quantile function's knots: each (share, length), from share 0 (the first length given,
        unless the shortest is given at share 0)."""
        qs = sorted(self.quantiles)
        xs, ys = tuple(qs), tuple(float(self.quantiles[q]) for q in qs)
        return (xs, ys) if qs[0] == 0.0 else ((0.0, *xs), (ys[0], *ys))

    @property
    def knots(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(shares, lengths) of the quantile function, linear between them."""
        return self._knots

    @property
    def longest(self) -> int:
        return self.quantiles[1.0]

    def quantile(self, u: float) -> float:
        """The length at cumulative share u ∈ [0, 1]: linear between the knots."""
        xs, ys = self._knots
        u = min(max(u, 0.0), 1.0)
        i = bisect.bisect_left(xs, u)
        if i == 0:
            return ys[0]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y1 if x1 == x0 else y0 + (y1 - y0) * (u - x0) / (x1 - x0)

    def expected_longest(self, n: int) -> float:
        """E[the longest of n independent draws] = ∫ quantile(u) d(uⁿ), exact on each linear piece: what a batch
        of n rows padded to its own longest is as wide as (rows in no order)."""
        xs, ys = self._knots
        total = 0.0
        for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False):
            if x1 == x0:
                continue
            slope = (y1 - y0) / (x1 - x0)  # ∫ (y0 + slope·(u - x0)) n·u^(n-1) du over [x0, x1]
            total += (y0 - slope * x0) * (x1**n - x0**n) + slope * n / (n + 1) * (x1 ** (n + 1) - x0 ** (n + 1))
        return total

    def sample(self, n: int) -> list[int]:
        """n lengths, ascending: the quantile function at shares (i + ½)/n, rounded; the last one is the
        longest (a batch of any size holds the tail it would meet)."""
        out = [max(1, round(self.quantile((i + 0.5) / n))) for i in range(n)]
        out[-1] = self.longest
        return out

    @cached_property
    def mean(self) -> float:
        return _linear_moment(*self._knots, 1)

    @cached_property
    def mean_square(self) -> float:
        return _linear_moment(*self._knots, 2)

    def describe(self) -> str:
        qs = sorted(self.quantiles)
        if qs == [1.0]:
            return f"{self.longest} tokens"
        if len(qs) > 6:  # many knots (observed lengths, max_entropy): the usual summary
            return (f"mean {self.mean:,.0f}, " + ", ".join(f"p{q:g} {round(self.quantile(q / 100)):,}" for q in (50, 90, 99))
                    + f", max {self.longest:,} tokens")
        return f"mean {self.mean:,.0f}, " + ", ".join(
            ("min" if q == 0.0 else f"p{q * 100:g}") + f" {self.quantiles[q]:,}" for q in qs if q < 1.0
        ) + f", max {self.longest:,} tokens"
