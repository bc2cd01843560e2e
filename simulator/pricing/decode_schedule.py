"""Which sequences decode together, step by step, when responses differ in length.

A generation replica holds `slots` sequences at once (what its KV cache and max_num_seqs allow).
Under continuous batching (vLLM, SGLang, the native engine) a finished sequence's slot takes the next
prompt at once, so the batch stays full until the queue empties and then drains: the tail where a few
long responses decode at a small batch. A static engine (HF generate, Megatron's loop, a fixed batch
per call) runs each batch until its longest response ends, finished rows still in it. A serving engine
handed a fixed batch per call (OpenRLHF v0.2's vLLM calls, `drain`) also waits for the call's longest,
but a finished sequence leaves its running batch: each call drains like a continuous batch's tail. A replica's
decode is a list of segments — runs of steps with the same sequences in flight — whose per-step price
is linear in the context they hold, so cost.py prices each segment in closed form.

The phase ends with its slowest data-parallel replica. Sequences are dealt to replicas from the
sorted lengths (each replica one of every dp consecutive lengths), so the replica dealt the top of
every block holds, length by length, at least what any other holds: it is the slowest, and the only
one priced. Within a replica the arrival order is a fixed low-discrepancy shuffle (lengths come in no
order in a real batch), so prices are deterministic.
"""

from __future__ import annotations

import heapq
import math
from functools import lru_cache
from typing import NamedTuple

from hybridflow.simulator.vocabulary.lengths import LengthDistribution

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


class Segment(NamedTuple):
    steps: int  # decode steps with these sequences in flight
    batch: int  # sequences in flight
    generated: int  # tokens they hold beyond their prompts at the segment's first step (Σ over the batch)


class ReplicaDecode(NamedTuple):
    segments: tuple[Segment, ...]
    admissions: int  # batches of prompts prefilled (continuous: one per refill event)
    sequences: int
    tokens: int  # response tokens generated (Σ lengths)


@lru_cache(maxsize=64)
def slowest_replica_lengths(dist: LengthDistribution, sequences: int, dp: int) -> tuple[int, ...]:
    """The lengths the slowest of dp replicas decodes (ceil(sequences/dp) of them), in arrival order."""
    ordered = dist.sample(sequences)
    mine = ordered[::-1][::dp]  # the top of each block of dp, from the longest down
    order = sorted(range(len(mine)), key=lambda i: (i * GOLDEN) % 1.0)
    return tuple(mine[i] for i in order)


@lru_cache(maxsize=256)
def replica_decode(lengths: tuple[int, ...], slots: int, continuous: bool, drain: bool = False) -> ReplicaDecode:
    """One replica's decode of `lengths` (arrival order) with `slots` sequences at most in flight. A
    response of L tokens takes L - 1 decode steps (its prefill yields the first), at contexts prompt + 1
    … prompt + L - 1. Static (not `continuous`): batches of `slots`, each until its longest ends, its finished
    rows still decoding, or, with `drain`, leaving the running batch as they finish."""
    if continuous:
        return _continuous(lengths, slots)
    segments, admissions = [], 0
    for i in range(0, len(lengths), slots):
        wave = lengths[i:i + slots]
        admissions += 1
        if drain:  # no refill: the call's own sequences only
            segments.extend(_continuous(wave, slots).segments)
        elif max(wave) > 1:
            segments.append(Segment(max(wave) - 1, len(wave), len(wave)))
    return ReplicaDecode(tuple(segments), admissions, len(lengths), sum(lengths))


def _continuous(lengths: tuple[int, ...], slots: int) -> ReplicaDecode:
    segments: list[Segment] = []
    queue = list(lengths)[::-1]  # pop() takes the next arrival
    active: list[tuple[int, int]] = []  # (finishing step, joining step)
    t = joined_sum = admissions = 0
    while queue or active:
        if queue and len(active) < slots:
            admissions += 1
            while queue and len(active) < slots:
                length = queue.pop()
                if length > 1:  # a one-token response is done after its prefill
                    heapq.heappush(active, (t + length - 1, t))
                    joined_sum += t
            if not active:
                continue
        end = active[0][0]
        b = len(active)
        segments.append(Segment(end - t, b, b * (1 + t) - joined_sum))  # each holds 1 + (t - joined) tokens
        t = end
        while active and active[0][0] == t:
            joined_sum -= heapq.heappop(active)[1]
    return ReplicaDecode(tuple(segments), admissions, len(lengths), sum(lengths))
