"""Timeline: what happened (or would happen) in one or more iterations, op by op.

The simulator emits one for a Plan; the runtime records one for every real iteration; the same
exporters draw both. Times are seconds from the start of the first iteration.

An op belongs to the iteration whose batch it works on: a pipelined plan's rollout of batch i runs
during iteration i − 1 and is iteration i's (a weight sync, to the iteration it delays). An
iteration's seconds, simulated or measured alike, run from its first op's start — or from the end
of the iteration before, if that is later — to its last op's end (`iteration_seconds`): for a
synchronous plan the span of its ops; for a pipelined one, whose rollout overlaps the iteration
before, the seconds from one trained batch's end to the next. A run's figure is over its steady
iterations — all but the first of a measured run (first calls allocate, compile and warm caches),
all but a simulated pipeline's warm-up — averaged over each sync period (k iterations of a plan that
syncs every k, `meta["staleness"]`): the median of those over a measured run (noise), the last one of
a simulation (no noise; the first periods still carry the pipeline filling). Throughput is one figure
everywhere, `throughput`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The shared op names (docs/architecture.md).
OPS = (
    "generate", "generate_baseline", "actor_logprob", "ref_logprob", "values", "reward", "cost",
    "advantage", "actor_update", "critic_update", "reshard", "weight_sync", "offload", "onload",
)
# The ops that bring the trained weights to generation: the 3D-HybridEngine reshard on the same
# devices, the weight sync (a broadcast) to separate rollout devices.
WEIGHT_SYNC_OPS = ("reshard", "weight_sync")
GENERATE_OPS = ("generate", "generate_baseline")  # the actor's rollouts (ReMax's greedy baseline too)
UPDATE_OPS = ("actor_update", "critic_update")  # the optimizer steps
OFFLOAD_OPS = ("offload", "onload")  # a model's states moved to host memory and back


def throughput(tokens_per_iteration: int, seconds: float) -> float:
    """THE throughput figure (the HybridFlow paper's): tokens per iteration — the tokens really processed:
    a plan's prompts × samples per prompt × (prompt length + mean response length) (Workload), a run's
    real prompt and response tokens; with fixed lengths the paper's (prompt + response length) — per
    second of an iteration. The live progress bar, the tables, the PNG title and --json all use this."""
    return tokens_per_iteration / seconds if seconds > 0 else 0.0


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    op: str
    role: str
    group: str  # device group (lane) it ran on; "driver" for controller-side work
    start: float
    end: float
    iteration: int = 0
    bytes: float = 0.0
    flops: float = 0.0
    breakdown: dict[str, float] = Field(default_factory=dict)  # seconds by part: compute, comm, memory, bubble…

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: Literal["simulated", "measured"]
    events: list[Event] = Field(default_factory=list)
    tokens_per_iteration: int = 0
    meta: dict = Field(default_factory=dict)

    def iterations(self) -> list[int]:
        return sorted({e.iteration for e in self.events})

    def steady_iterations(self) -> list[int]:
        """The iterations a run's figures come from: a measured run's first is left out when there are more,
        and a simulated pipeline's warm-up (meta `warmup_iterations`)."""
        its = self.iterations()
        skip = 1 if self.source == "measured" else self.meta.get("warmup_iterations", 0)
        return its[skip:] if len(its) > skip else its

    def iteration_seconds(self, iteration: int | None = None) -> float:
        """One iteration's seconds (the module doc); None: the run's figure over its steady iterations."""
        if iteration is None:
            its = self.steady_iterations()
            if not its:
                return 0.0
            k = max(1, min(self.meta.get("staleness", 0), len(its)))  # iterations per sync period
            periods = [sum(self.iteration_seconds(i) for i in its[j - k:j]) / k for j in range(k, len(its) + 1)]
            settled = self.source == "simulated" and self.meta.get("staleness", 0) > 0
            return periods[-1] if settled else statistics.median(periods)
        evs = [e for e in self.events if e.iteration == iteration]
        if not evs:
            return 0.0
        start = min(e.start for e in evs)
        before = [e.end for e in self.events if e.iteration < iteration]
        return max(e.end for e in evs) - max(start, max(before, default=start))

    def tokens_per_second(self, iteration: int | None = None) -> float:
        return throughput(self.tokens_per_iteration, self.iteration_seconds(iteration))

    def op_seconds(self, iteration: int | None = None) -> dict[str, float]:
        """Seconds per op name, summed over roles/groups; None: per steady iteration, each op's median
        when every steady iteration has it, else its mean share (an async plan's weight sync, once per k
        iterations: the median would say 0, the share is what each iteration pays for it)."""
        if iteration is not None:
            total: dict[str, float] = defaultdict(float)
            for e in self.events:
                if e.iteration == iteration:
                    total[e.op] += e.seconds
            return dict(total)
        per = [self.op_seconds(i) for i in self.steady_iterations()]
        ops = dict.fromkeys(op for p in per for op in p)  # in order of first appearance

        def typical(op: str) -> float:
            seen = [p[op] for p in per if op in p]
            return statistics.median(seen) if len(seen) == len(per) else sum(seen) / len(per)

        return {op: typical(op) for op in ops}
