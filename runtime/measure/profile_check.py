"""Is a profile still this machine's? Re-time some of its own points and compare.

A profile records the machine's speed at the time it was measured. On a shared machine (a cloud VM,
a busy node) that speed drifts: the same jobs can run 10–20 % slower an hour later. The check re-runs
the profile's one-device train, forward and generate points of one model on the same profiler
(runtime/measure/profiling.py, no hardware probe) and reports, per point and as a median, seconds now /
seconds then. `hflow-plan profile --check FILE` prints it; the accuracy benchmark runs it every round
so its table can tell the model's error from the machine's drift.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hybridflow.simulator.calibration.profile import Profile
from hybridflow.simulator.errors import HflowError

REFERENCE_OPS = ("train", "forward", "generate")
REFERENCE_MODEL = "tiny"  # the default grid's middle model (17 one-device points)
JOB_KEYS = ("op", "head", "batch", "micro_batch", "steps", "prompt_len", "response_len")


@dataclass(frozen=True)
class SpeedCheck:
    """Per reference point: the job, its profiled seconds and its seconds now."""

    jobs: list[dict]
    profiled: list[float]
    now: list[float]

    @property
    def ratios(self) -> list[float]:
        return [n / p for n, p in zip(self.now, self.profiled, strict=True)]

    @property
    def index(self) -> float:
        """The median ratio now / profiled (> 1: the machine runs slower than when profiled)."""
        return statistics.median(self.ratios)


def reference_jobs(profile: Profile, model: str = REFERENCE_MODEL,
                   max_seconds: float | None = None) -> tuple[list[dict], list[float]]:
    """The profile's one-device train, forward and generate points of `model`, as profiler jobs, and
    their recorded seconds (only those that took at most `max_seconds`, when given: a quick check)."""
    points = [p for p in profile.points if p.op in REFERENCE_OPS and p.model is not None
              and p.model.name == model and p.parallel.world_size == 1
              and (max_seconds is None or p.seconds <= max_seconds)]
    if not points:
        raise HflowError(f"profile '{profile.name}' has no one-device train/forward/generate points of model "
                         f"'{model}' to re-time; check a profile measured by `hflow-plan profile` (not --quick)")
    jobs = [{**{k: getattr(p, k) for k in JOB_KEYS}, "model": p.model.model_dump(), "parallel": {}} for p in points]
    return jobs, [p.seconds for p in points]


def check_speed(profile: Profile, devices: int | None = None, model: str = REFERENCE_MODEL,
                max_seconds: float | None = None) -> SpeedCheck:
    """Re-time `profile`'s reference points on this machine, on as many devices as it used (every
    device runs its own copy at once, as when profiled); `max_seconds`: only the points that took at
    most that long when profiled (the quick check `run` and `quickstart` make at the start)."""
    from hybridflow.runtime.measure.process_group import run_group
    from hybridflow.runtime.measure.profiling import measure_jobs

    jobs, profiled = reference_jobs(profile, model, max_seconds)
    rows = run_group(measure_jobs, devices or profile.fingerprint.devices, jobs, 1, 3)[0]
    return SpeedCheck(jobs=jobs, profiled=profiled, now=[r["seconds"] for r in rows])
