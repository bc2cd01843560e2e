"""What a run tells its caller as it goes, so that no phase looks like a hang.

The trainer calls these hooks; this base class ignores them and tools/reports/run.py renders them
(a line per phase, a progress bar for the warm-up and for the iterations).

    ray        Ray is starting locally, or joining a cluster
    warmup     a built-in policy is being warmed up (the first time only); `total` steps follow
    workers    the worker processes of a device group are starting
    weights    a role's workers are loading its weights
    resume     the run continues from a checkpoint
    restart    the worker groups start again after a lost worker or node (`max_restarts`)
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["ray", "warmup", "workers", "weights", "resume", "restart"]


class RunEvents:
    def phase(self, name: Phase, text: str, total: int | None = None) -> None:
        """A phase begins; `text` says what happens, for a person. With `total`, `advance` follows."""

    def advance(self, done: int) -> None:
        """`done` of the current phase's `total` steps are complete."""

    def say(self, text: str) -> None:
        """A line for a person within a phase: a slow start, a group's placement, a restart."""
