"""An op's price (OpCost) and the FLOP arithmetic of a decoder that every op's pricing shares.

cost.py prices training, forward passes and weight moves with these, generation.py prefill and decoding.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import BaseModel, Field

from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.model import Head, ModelSpec
from hybridflow.simulator.vocabulary.workload import Workload


class OpCost(BaseModel):
    """An op's price. breakdown: seconds by part (they sum to `seconds`)."""

    seconds: float
    flops: float = 0.0
    bytes: float = 0.0
    breakdown: dict[str, float] = Field(default_factory=dict)


def op_cost(flops: float, nbytes: float, **parts: float) -> OpCost:
    """An OpCost of `parts` (seconds by name; the non-positive ones left out)."""
    parts = {k: float(v) for k, v in parts.items() if v > 0.0}
    return OpCost.model_construct(seconds=sum(parts.values()), flops=float(flops), bytes=float(nbytes),
                                  breakdown=parts)


def times(cost: OpCost, n: float) -> OpCost:
    """`cost` paid `n` times over."""
    if n == 1:
        return cost
    return OpCost.model_construct(seconds=cost.seconds * n, flops=cost.flops * n, bytes=cost.bytes * n,
                                  breakdown={k: v * n for k, v in cost.breakdown.items()})


def plus(a: OpCost, b: OpCost) -> OpCost:
    """Two prices of one op added, part by part."""
    parts = dict(a.breakdown)
    for k, v in b.breakdown.items():
        parts[k] = parts.get(k, 0.0) + v
    return OpCost.model_construct(seconds=a.seconds + b.seconds, flops=a.flops + b.flops, bytes=a.bytes + b.bytes,
                                  breakdown=parts)


@lru_cache(maxsize=256)
def model_shape(model: ModelSpec, head: Head) -> tuple[float, float, float, float]:
    """(parameters, matmul parameters, attention FLOPs per token per context token, KV bytes per token)."""
    attn = 4.0 * model.layers * model.heads * model.dim_head
    return float(model.num_params(head)), float(model.matmul_params(head)), attn, float(model.kv_bytes_per_token())


def causal_keys(seq_len: float, key_block: float = 0.0) -> float:
    """Keys a query of a causal sequence of `seq_len` tokens computes, on average: (s + 1)/2, or with an
    attention kernel that walks the keys in blocks of `key_block` and computes every key of each block it
    enters (the diagonal block whole) min(s, (s + key_block)/2), exact at multiples of the block."""
    if key_block <= 0:
        return (seq_len + 1) / 2.0
    return min(seq_len, (seq_len + key_block) / 2.0)


def seq_flops(pm: float, attn: float, seq_len: float, attention_efficiency: float = 1.0,
              key_block: float = 0.0) -> float:
    """Forward FLOPs of one causal sequence (each token attends to (s+1)/2 tokens on average; with a
    `key_block`, to causal_keys); with `attention_efficiency` < 1 the attention's share is weighted up by it
    (its kernels' slower FLOPs), which makes this the matmul-equivalent work a compute time is priced from."""
    return seq_len * (2.0 * pm + attn * causal_keys(seq_len, key_block) / attention_efficiency)


def mean_seq_flops(pm: float, attn: float, workload: Workload, attention_efficiency: float = 1.0,
                   key_block: float = 0.0) -> float:
    """E[seq_flops(P + L)] over the workload's response lengths L (exact: from the first two moments, and with
    a `key_block` piece by piece of the quantile function)."""
    d, P = workload.response_lengths, workload.prompt_len
    mean_x = P + d.mean
    if key_block > 0:
        return 2.0 * pm * mean_x + attn * _mean_blocked_pairs(d, P, key_block) / attention_efficiency
    mean_x2 = P * P + 2 * P * d.mean + d.mean_square
    return 2.0 * pm * mean_x + attn * (mean_x2 + mean_x) / 2.0 / attention_efficiency


@lru_cache(maxsize=256)
def _mean_blocked_pairs(d: LengthDistribution, prompt_len: int, block: float) -> float:
    """E[X · causal_keys(X, block)] for X = prompt_len + L: the quantile function is linear between its knots,
    so each piece integrates x² (x ≤ block) and (x² + block·x)/2 (x > block) in closed form."""
    def primitive(x: float) -> float:  # ∫_0^x of the integrand, continuous at the block
        if x <= block:
            return x**3 / 3.0
        return block**3 / 3.0 + (x**3 - block**3) / 6.0 + block * (x * x - block * block) / 4.0

    total, (us, ys) = 0.0, d.knots
    for u0, u1, y0, y1 in zip(us, us[1:], ys, ys[1:], strict=False):
        x0, x1 = prompt_len + y0, prompt_len + y1
        if u1 == u0:
            continue
        if x1 == x0:
            total += (u1 - u0) * x0 * causal_keys(x0, block)
        else:
            total += (u1 - u0) * (primitive(x1) - primitive(x0)) / (x1 - x0)
    return total
