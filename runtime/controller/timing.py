"""Op timing as workers report it, in one shape: `{op: [start, end, bytes]}` (wall-clock seconds of the
worker's process, `time.time()`, and the bytes the op moved into that device, 0 for none).

Workers time their own ops because only the worker knows when a call really started: calls queued on
a busy colocated process wait their turn. A timing travels back with the op's output: in a Batch's
meta under "timing", or as the "timing" entry of a dict. Where several ranks (or both sides of a
weight sync) report one op, `merge_timings` makes it one span: from the first start to the last end,
with the bytes of the device that received most (the simulator's convention: bytes per device).

    timing = {}
    with timed(timing, "values"):
        ...
    return with_timing(Batch({"values": v}), timing)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

Timing = dict[str, list[float]]  # op -> [start, end, bytes]


@contextmanager
def timed(timing: Timing, op: str) -> Iterator[list[float]]:
    """Record `op`'s span in `timing`; the yielded span's bytes (index 2) may be set inside."""
    span = [time.time(), 0.0, 0.0]
    try:
        yield span
    finally:
        span[1] = time.time()
        timing[op] = span


def with_timing(out: Any, timing: Timing) -> Any:
    """`out` (a Batch or a dict) carrying `timing` back to the driver."""
    if isinstance(out, dict):
        return {**out, "timing": dict(timing)}
    out.meta["timing"] = dict(timing)
    return out


def timing_of(out: Any) -> Timing:
    """The timing an output carries (removed from it), {} if none."""
    if isinstance(out, dict):
        return out.pop("timing", {})
    return out.meta.pop("timing", {})


def merge_timings(timings: Iterable[Timing]) -> Timing:
    """One span per op over several reports of it: first start, last end, the most bytes."""
    merged: Timing = {}
    for timing in timings:
        for op, (start, end, *nbytes) in timing.items():
            got = float(nbytes[0]) if nbytes else 0.0
            old = merged.get(op)
            merged[op] = [start, end, got] if old is None else [min(old[0], start), max(old[1], end), max(old[2], got)]
    return merged
