"""A batch's rollout made as several `generate` calls, one after another on the same devices.

Two systems split a batch so: DeepSpeed-Chat generates once per PPO mini-batch (Mechanics.generate_per_minibatch),
and this runtime's `async` mode launches each batch's prompts as STREAM_CHUNKS calls (runtime/rl/modes/streaming.py:
its groups stream into the queue as each call ends), which a rollout worker serves one at a time. Each call waits
for its own longest response, so with a long tail of lengths the calls together take longer than one call of
the whole batch: the short one is not hidden under the long one, and each decodes at its share of the batch.

The batch's lengths are drawn as one call draws them (LengthDistribution.sample: the tail the batch meets) and
dealt to the calls from the longest down, one of every `calls` consecutive lengths each — as the replicas of a
call are dealt theirs (decode_schedule.py), so a price never depends on a seed. Without a distribution every call
is the same: the batch's share, priced once.
"""

from __future__ import annotations

from hybridflow.simulator.pricing.op_cost import OpCost, plus, times
from hybridflow.simulator.vocabulary.plan import stream_calls
from hybridflow.simulator.vocabulary.workload import Workload


def call_shares(workload: Workload, sequences: int, calls: int) -> list[tuple[Workload, int]]:
    """(workload, sequences) of each of `calls` calls making `sequences` rollouts of `workload`."""
    dist = workload.response_lengths
    if calls == 1:
        return [(workload, sequences)]
    if dist is None:
        return [(workload, -(-sequences // calls))] * calls
    dealt = sorted(dist.sample(sequences), reverse=True)
    out = []
    for c in range(min(calls, sequences)):
        mine = dealt[c::calls]
        out.append((workload.model_copy(update={"response_lengths": type(dist)(observed=mine)}), len(mine)))
    return out


def sequential_generate(cm, model, gen, workload: Workload, sequences: int, calls: int, gap: float = 0.0,
                        **kwargs) -> OpCost:
    """`cm.generate` of `sequences` rollouts made by `calls` calls in turn (kwargs: generate's memory and batching
    arguments), each call after the first `gap` seconds after the one before it (the controller's)."""
    shares = call_shares(workload, sequences, calls)
    if workload.response_lengths is None:
        total = times(cm.generate(model, gen, workload, shares[0][1], **kwargs), len(shares))
    else:
        total = None
        for w, n in shares:
            one = cm.generate(model, gen, w, n, **kwargs)
            total = one if total is None else plus(total, one)
    waits = gap * (len(shares) - 1)
    if waits <= 0.0:
        return total
    return plus(total, OpCost.model_construct(seconds=waits, flops=0.0, bytes=0.0, breakdown={"dispatch": waits}))


class StreamedRollout:
    """A cost model (any: the analytic one, a profile's) whose `generate` is the `async` mode's rollout of a batch:
    its STREAM_CHUNKS calls in turn (module doc). Every other price is the wrapped model's."""

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)

    def generate(self, model, gen, workload: Workload, sequences: int | None = None,
                 free_bytes_per_device: float | None = None, batch_cap: int | None = None,
                 gather_every_step: bool = False, drain_calls: bool = False) -> OpCost:
        seqs = workload.sequences if sequences is None else sequences
        # the calls are queued on the rollout group together: each after the first waits the controller's gap
        # between queued calls (a profile's; the schedule prices the first call's dispatch)
        gap = getattr(getattr(self.base, "overheads", None), "queued_call_seconds", 0.0)
        return sequential_generate(self.base, model, gen, workload, seqs, stream_calls(workload.prompts), gap,
                                   free_bytes_per_device=free_bytes_per_device, batch_cap=batch_cap,
                                   gather_every_step=gather_every_step, drain_calls=drain_calls)
