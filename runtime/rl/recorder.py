"""OpRecorder: what a run's ops did, in the vocabulary the simulator prices.

Two records: each call as issued, `(op, role)` in order (`calls`; dynamic sampling's extra rounds in
`resampled_calls`), which tests compare with the graph the simulator builds from the same algorithm
loop; and each op's span in the measured Timeline, with the worker's own start and end
(controller/timing.py), relative to the run's `origin` so that the iterations of every attempt of a
restarted run share one clock. An op belongs to the iteration whose batch it works on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from hybridflow.runtime.controller.timing import Timing, merge_timings, timing_of
from hybridflow.simulator.vocabulary.timeline import Event


class OpRecorder:
    def __init__(self, origin: float | None = None):
        self.origin = time.time() if origin is None else origin
        self.events: list[Event] = []
        self.start_iteration(0)

    def start_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.calls: list[tuple[str, str]] = []  # (op, role) as issued; the simulator's graph has the same
        self.resampled_calls: list[tuple[str, str]] = []  # dynamic sampling's extra rounds
        self.resampling = False

    def log(self, op: str, role: str) -> None:
        (self.resampled_calls if self.resampling else self.calls).append((op, role))

    def record(self, role: str, group: str, timing: Timing, iteration: int | None = None) -> None:
        """Each op of `timing` as an event on `group`'s lane, in `iteration` (default: the current one)."""
        for op, (start, end, *nbytes) in timing.items():
            self.events.append(Event(op=op, role=role, group=group, start=start - self.origin,
                                     end=end - self.origin, iteration=self.iteration if iteration is None else iteration,
                                     bytes=float(nbytes[0]) if nbytes else 0.0))

    def record_outputs(self, role: str, group: str, outputs: Iterable[Any], iteration: int | None = None) -> None:
        """The timings several ranks' (or both sides') outputs carry, merged into one span per op."""
        self.record(role, group, merge_timings(timing_of(o) for o in outputs), iteration)

    def span(self, op: str, role: str, start: float) -> None:
        """An op the driver ran itself, from `start` to now (lane "driver")."""
        self.record(role, "driver", {op: [start, time.time(), 0.0]})
