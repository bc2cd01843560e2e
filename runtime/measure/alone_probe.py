"""How much faster a device runs while the other devices of its node idle: the `alone` points.

A profile times every one-device point on all devices at once, each its own copy (runtime/measure/profiling.py),
as a colocated plan keeps them. A plan whose device groups take turns — a disaggregated rollout's
devices while the trainers work, and back — runs some ops with the rest of the node idle, and where
the devices share the host's resources (sibling hyperthreads, caches, memory bandwidth: a CPU VM) an
op then runs faster. This probe re-times the profile's reference points (runtime/measure/profile_check.py)
on one device alone and on all at once, back to back, `passes` times, and keeps each point's median
per side; the calibration's `alone_speedup` is the median ratio (simulator/calibration/fit.py).

    points = measure_alone(profile)  # per reference job: one point on 1 device, one on all of them
"""

from __future__ import annotations

import statistics

from hybridflow.simulator.calibration.profile import Profile, ProfilePoint


def measure_alone(profile: Profile, passes: int = 3, max_seconds: float | None = None) -> list[ProfilePoint]:
    """Per reference job of `profile` (those that took at most `max_seconds` when profiled, when given):
    its median seconds on one device with the others idle (group_size 1) and on all the profile's
    devices at once (group_size = devices)."""
    from hybridflow.runtime.measure.profile_check import check_speed

    devices = profile.fingerprint.devices
    alone: list[list[float]] = []
    busy: list[list[float]] = []
    jobs: list[dict] = []
    for _ in range(passes):  # alternated: a shared machine's speed drifts between minutes
        a = check_speed(profile, devices=1, max_seconds=max_seconds)
        b = check_speed(profile, devices=devices, max_seconds=max_seconds)
        jobs = a.jobs
        alone.append(a.now)
        busy.append(b.now)
    points = []
    for i, job in enumerate(jobs):
        for size, runs in ((1, alone), (devices, busy)):
            points.append(ProfilePoint(
                op="alone", mode=job["op"], model=job["model"], head=job["head"], batch=job["batch"],
                micro_batch=job["micro_batch"], steps=job["steps"], prompt_len=job["prompt_len"],
                response_len=job["response_len"], group_size=size, repeats=passes,
                seconds=statistics.median(r[i] for r in runs)))
    return points
