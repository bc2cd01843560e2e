"""A device that runs while the other devices of its node idle: the schedule's alone speed.

A profile times its points with every device of the node busy (runtime/measure/profiling.py), as a colocated
plan keeps them. Where a node's devices share resources (a CPU VM's sibling hyperthreads, caches and
memory bandwidth) a device whose neighbours idle runs faster: `alone_speedup` times
(simulator/calibration/fit.py, measured by runtime/measure/alone_probe.py; 1 on a GPU node, where nothing
changes). The speed of a device goes from the busy one with all N devices of its node working to
`alone_speedup` times it with only its own working, linearly in how many work — the two ends are
what the profile measures.

An op is priced over its span: at each moment the devices of its node(s) that work are its own and
those of any other op then running there; an op on several nodes runs at its slowest node's speed
(its devices step together). Every op on devices takes part, a weight sync between two groups too
(both its groups work, so on one node it keeps the busy speed); the driver's ops run on the
controller and neither get nor give the term. A group that fills its node always runs at the busy
speed, as the profile measured it. `reprice` gives each op its seconds with the other ops where a
schedule put them; schedule.schedule_shared iterates schedule → reprice to a fixed point.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from hybridflow.simulator.schedule.dataflow import DRIVER, Lanes, lanes_tuple


@dataclass(frozen=True)
class NodeShare:
    """Which devices of which node each lane holds, and how much faster a device runs alone."""

    alone_speedup: float
    devices_per_node: int
    lane_devices: Mapping[str, Mapping[int, frozenset[int]]]  # lane → node → device indices


def node_share(alone_speedup: float, groups: Mapping[str, Iterable], devices_per_node: int) -> NodeShare | None:
    """The share for lanes named after device groups (`groups`: lane → its Devices); None when the term
    changes nothing (a speedup of 1, or nodes of one device)."""
    if alone_speedup <= 1.0 or devices_per_node < 2:
        return None
    lanes: dict[str, dict[int, frozenset[int]]] = {}
    for name, devices in groups.items():
        by_node: dict[int, set[int]] = {}
        for d in devices:
            by_node.setdefault(d.node, set()).add(d.index)
        lanes[name] = {k: frozenset(v) for k, v in by_node.items()}
    return NodeShare(alone_speedup, devices_per_node, lanes)


def _devices(lanes: Lanes, share: NodeShare) -> dict[int, frozenset[int]]:
    out: dict[int, frozenset[int]] = {}
    for lane in lanes_tuple(lanes):
        for k, idx in share.lane_devices.get(lane, {}).items():
            out[k] = out.get(k, frozenset()) | idx
    return out


def reprice(times: Mapping[Hashable, tuple[float, float]], lane_of: Mapping[Hashable, Lanes],
            seconds: Mapping[Hashable, float], share: NodeShare) -> dict[Hashable, float]:
    """Each device op's seconds (`seconds`: at the profile's busy speed) when it starts where `times`
    starts it and the other ops keep their spans there: its work done at 1× while all of its node's
    devices work, up to `alone_speedup`× while only its own do, until it is all done."""
    ops = []
    for n, (s, e) in times.items():
        if lane_of[n] != DRIVER and e > s:
            devs = _devices(lane_of[n], share)
            if devs:
                ops.append((n, s, e, devs))
    per_node: dict[int, list[tuple[float, float, frozenset[int], Hashable]]] = {}
    for n, s, e, devs in ops:
        for k, idx in devs.items():
            per_node.setdefault(k, []).append((s, e, idx, n))
    full, gain = share.devices_per_node, share.alone_speedup - 1.0
    out: dict[Hashable, float] = {}
    for n, s, _, devs in ops:
        others = {k: [(s2, e2, idx) for s2, e2, idx, m in per_node[k] if m != n and e2 > s] for k in devs}
        cuts = sorted({s, *(t for k in others for a, b, _ in others[k] for t in (a, b) if t > s)})
        left, at = seconds[n], s
        for a, b in zip(cuts, [*cuts[1:], math.inf], strict=True):
            speed = math.inf
            for k, own in devs.items():
                busy = set(own)
                for a2, b2, idx in others[k]:
                    if a2 <= a and b2 >= b:
                        busy |= idx
                speed = min(speed, 1.0 + gain * max(full - len(busy), 0) / (full - 1))
            if left <= (b - a) * speed:
                at = a + left / speed
                break
            left -= (b - a) * speed
        out[n] = at - s
    return out
