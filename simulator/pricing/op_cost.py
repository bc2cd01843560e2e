"""An op's price (OpCost) and the FLOP arithmetic of a decoder that every op's pricing shares.

cost.py prices training, forward passes and weight moves with these, generation.py prefill and decoding.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import BaseModel, Field

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


@lru_cache(maxsize=256)
def model_shape(model: ModelSpec, head: Head) -> tuple[float, float, float, float]:
    """(parameters, matmul parameters, attention FLOPs per token per context token, KV bytes per token)."""
    attn = 4.0 * model.layers * model.heads * model.dim_head
    return float(model.num_params(head)), float(model.matmul_params(head)), attn, float(model.kv_bytes_per_token())


def seq_flops(pm: float, attn: float, seq_len: float, attention_efficiency: float = 1.0) -> float:
    """Forward FLOPs of one causal sequence (each token attends to (s+1)/2 tokens on average); with
    `attention_efficiency` < 1 the attention's share is weighted up by it (its kernels' slower FLOPs),
    which makes this the matmul-equivalent work a compute time is priced from."""
    return seq_len * (2.0 * pm + attn * (seq_len + 1) / 2.0 / attention_efficiency)


def mean_seq_flops(pm: float, attn: float, workload: Workload, attention_efficiency: float = 1.0) -> float:
    """E[seq_flops(P + L)] over the workload's response lengths L (exact from the first two moments)."""
    d, P = workload.response_lengths, workload.prompt_len
    mean_x = P + d.mean
    mean_x2 = P * P + 2 * P * d.mean + d.mean_square
    return 2.0 * pm * mean_x + attn * (mean_x2 + mean_x) / 2.0 / attention_efficiency
