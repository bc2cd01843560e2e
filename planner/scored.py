"""A priced plan as the search keeps it (before it becomes a Plan: only the winners do, plans.py), and
where its actor generates."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.planner.placement import Placement
from hybridflow.planner.pricing import Candidate
from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES
from hybridflow.simulator.vocabulary.roles import ROLLOUT


@dataclass(frozen=True)
class Rollout:
    """Where the actor generates and how rollout and training take turns (Plan.mode, Plan.staleness)."""

    mode: str = "sync"
    staleness: int = 0  # 0 sync, 1 one-step-off, k async
    separate: bool = False  # on devices of its own (a ROLLOUT set), not the actor's (3D-HybridEngine)

    def __post_init__(self):
        if self.mode not in EXECUTION_MODES:
            raise ValueError(f"unknown mode {self.mode!r}")
        if (self.mode == "sync") != (self.staleness == 0) or (self.mode == "one-step-off" and self.staleness != 1):
            raise ValueError(f"mode {self.mode!r} has staleness {self.staleness}")
        if self.mode != "sync" and not self.separate:
            raise ValueError(f"mode {self.mode!r} needs separate rollout devices")


@dataclass(frozen=True)
class Scored:
    """One priced plan: iteration seconds, placement, devices per set, each role's configs."""

    seconds: float
    placement: Placement
    counts: tuple[int, ...]
    choice: tuple[tuple[str, Candidate], ...]  # (role, candidate) in the request's role order (+ ROLLOUT)
    rollout: Rollout = Rollout()
    offload: bool = False  # colocated models move their states to host memory while another runs (Plan.offload)

    def devices(self) -> dict[str, int]:
        return {r: self.counts[i] for i, s in enumerate(self.placement) for r in s}

    def rollout_devices(self) -> int:
        """Devices that only generate (0: the actor generates on its training devices)."""
        return self.devices().get(ROLLOUT, 0)

    def candidate(self, role: str) -> Candidate:
        return dict(self.choice)[role]
