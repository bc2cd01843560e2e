"""Timeline: what happened (or would happen) in one or more iterations, op by op.

The simulator emits one for a Plan; the runtime records one for every real iteration; the same
exporters draw both. Times are seconds from the start of the first iteration.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# The shared op names (DESIGN.md).
OPS = (
    "generate", "generate_baseline", "actor_logprob", "ref_logprob", "values", "reward", "cost",
    "advantage", "actor_update", "critic_update", "reshard", "offload", "onload",
)


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

    def iteration_seconds(self, iteration: int | None = None) -> float:
        evs = [e for e in self.events if iteration is None or e.iteration == iteration]
        if not evs:
            return 0.0
        if iteration is None:  # mean over iterations
            its = self.iterations()
            return sum(self.iteration_seconds(i) for i in its) / len(its)
        return max(e.end for e in evs) - min(e.start for e in evs)

    def tokens_per_second(self, iteration: int | None = None) -> float:
        s = self.iteration_seconds(iteration)
        return self.tokens_per_iteration / s if s > 0 else 0.0

    def op_seconds(self, iteration: int | None = None) -> dict[str, float]:
        """Seconds per op name, summed over roles/groups (mean over iterations when None)."""
        its = self.iterations() if iteration is None else [iteration]
        total: dict[str, float] = defaultdict(float)
        for e in self.events:
            if e.iteration in its:
                total[e.op] += e.seconds
        return {k: v / max(len(its), 1) for k, v in total.items()}
