"""A data-parallel rank's share of a batch of sequences and how it falls into micro-batches: rows
padded to each micro-batch's longest, or real tokens packed under a token budget; and the work per
sequence either way (attention grows with each sequence's own length). The training and forward
passes' prices (cost.py) and the profiled model's (calibration/profiled_cost.py) read them.
"""

from __future__ import annotations

import math

from hybridflow.simulator.pricing.op_cost import mean_seq_flops, seq_flops
from hybridflow.simulator.vocabulary.workload import Workload

# A role's packing budget when the caller names none: the planner's (plan.default_micro_batch_tokens), so a
# search prices what the plan it writes will run. price_op passes the plan's own knob (None: rows padded).
DEFAULT_BUDGET = "default"


def padded_widths(workload: Workload, per_rank: int, b: int) -> list[tuple[int, float]]:
    """(rows, padded width) of each of a rank's micro-batches of b rows without packing: the engine sorts the rank's
    rows by length and pads each micro-batch to its longest (engines/train/packing.py bucket_order). Row i of
    the rank's n sorted rows is the length at share (i + ½)/n, and the slowest rank holds the batch's longest
    (LengthDistribution.sample's rule)."""
    d, n = workload.response_lengths, per_rank
    tops = [min((j + 1) * b, n) - 1 for j in range(-(-n // b))]
    return [(min(b, n - j * b), workload.prompt_len + (d.longest if i == n - 1 else d.quantile((i + 0.5) / n)))
            for j, i in enumerate(tops)]


def padded_seq_flops(pm: float, attn: float, workload: Workload, per_rank: int, b: int,
                     attention_efficiency: float = 1.0, key_block: float = 0.0) -> float:
    """seq_flops per sequence of a rank's padded micro-batches (padded_widths): every row computes its
    micro-batch's width."""
    widths = padded_widths(workload, per_rank, b)
    return sum(r * seq_flops(pm, attn, w, attention_efficiency, key_block) for r, w in widths) / per_rank


def packed_seq_flops(pm: float, attn: float, workload: Workload, per_rank: int, groups: int,
                     attention_efficiency: float = 1.0, key_block: float = 0.0) -> float:
    """seq_flops per sequence of the slowest rank's packed micro-batches. The balanced partition evens the ranks'
    tokens, not their attention, which grows with each sequence's length: the slowest rank holds the batch's
    longest sequence (padded_widths' rule) and per_rank − 1 others of the rest's mean attention."""
    linear = 2.0 * pm * (workload.prompt_len + workload.mean_response_len)
    attention = mean_seq_flops(pm, attn, workload, attention_efficiency, key_block) - linear
    batch = per_rank * groups
    if groups <= 1 or per_rank < 1:
        return linear + attention
    longest = workload.prompt_len + workload.response_lengths.longest
    top = seq_flops(pm, attn, longest, attention_efficiency, key_block) - 2.0 * pm * longest
    others = max(0.0, batch * attention - top) / (batch - 1)
    return linear + (top + (per_rank - 1) * others) / per_rank


def micro_batches(workload: Workload, sequences: int, steps: int, dp: int,
                  micro_batch_tokens: int | None | str = DEFAULT_BUDGET) -> tuple[int, int, float]:
    """(sequences per rank per step, micro-batches per step, tokens per micro-batch) of one data-parallel
    rank. Rows (micro_batch_tokens None): micro_batch_size sequences per micro-batch, each padded to its
    longest (padded_widths under a length distribution). Packed (a token budget; DEFAULT_BUDGET: the
    planner's, micro_batch_size · seq_len, so activation memory stays the longest sequence's): sequences
    packed into micro-batches of at most that many real tokens, about equal tokens each."""
    per_rank = max(1, -(-sequences // (steps * dp)))
    b = min(workload.micro_batch_size, per_rank)
    if micro_batch_tokens == DEFAULT_BUDGET:
        micro_batch_tokens = b * workload.seq_len if workload.response_lengths is not None else None
    if micro_batch_tokens is None:
        if workload.response_lengths is None:
            return per_rank, -(-per_rank // b), float(b * workload.seq_len)
        widths = padded_widths(workload, per_rank, b)
        return per_rank, len(widths), sum(r * w for r, w in widths) / len(widths)
    if workload.response_lengths is None:  # whole sequences of seq_len tokens per budget
        return per_rank, -(-per_rank // max(1, micro_batch_tokens // workload.seq_len)), float(
            min(per_rank, max(1, micro_batch_tokens // workload.seq_len)) * workload.seq_len)
    rank_tokens = per_rank * (workload.prompt_len + workload.mean_response_len)
    m = max(1, math.ceil(rank_tokens / micro_batch_tokens - 1e-9))
    return per_rank, m, rank_tokens / m
