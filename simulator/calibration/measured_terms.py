"""The cost-model terms a profile measures directly rather than fits: the controller's dispatch gaps, the
rule-based reward's seconds per sequence, and how much faster a device runs while its neighbours idle.
calibration.calibrate takes them as measured after its fit."""

from __future__ import annotations

import statistics

from hybridflow.simulator.calibration.profile import Profile
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads
from hybridflow.simulator.pricing.efficiency import EfficiencyParams


def measured_directly(profile: Profile, params: EfficiencyParams,
                      overheads: EngineOverheads) -> tuple[EfficiencyParams, EngineOverheads]:
    """`params` and `overheads` with every term the profile has points for set as measured (others kept)."""
    gaps = {}
    for field, mode in (("dispatch_seconds", "dependent"), ("queued_call_seconds", "queued")):
        seen = [p.seconds for p in profile.points if p.op == "dispatch" and (p.mode or "dependent") == mode]
        if seen:  # the median gap the probe saw
            gaps[field] = statistics.median(seen)
    overheads = overheads.model_copy(update=gaps)
    rewards = [p.seconds / p.batch for p in profile.points if p.op == "reward"]
    if rewards:  # the median seconds per sequence over the built-in tasks
        params = params.model_copy(update={"rule_reward_seconds_per_sequence": statistics.median(rewards)})
    speedup = alone_speedup(profile)
    if speedup is not None:
        overheads = overheads.model_copy(update={"alone_speedup": speedup})
    return params, overheads


def alone_speedup(profile: Profile) -> float | None:
    """The profile's `alone` points' speedup (None: it has none): per reference job, its seconds with
    every device busy over its seconds with the others idle; the median over jobs, at least 1 (a
    device alone is never slower: a ratio under 1 is the machine's noise)."""
    by_job: dict[tuple, dict[bool, float]] = {}
    for p in profile.points:
        if p.op == "alone":
            key = (p.mode, p.model.name if p.model else "", p.head, p.batch, p.micro_batch, p.steps, p.prompt_len,
                   p.response_len)
            by_job.setdefault(key, {})[p.group_size == 1] = p.seconds
    ratios = [t[False] / t[True] for t in by_job.values() if len(t) == 2]
    if not ratios:
        return None
    return max(1.0, statistics.median(ratios))
