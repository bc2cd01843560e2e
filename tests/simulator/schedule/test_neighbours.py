"""A device whose neighbours idle runs `alone_speedup` times faster (simulator/schedule/neighbours.py): the fit
reads the factor off a profile's `alone` points, and the schedule prices each op on devices by how
much of its span the rest of its node works."""

import math

import networkx as nx
import pytest
from test_calibration import synthetic_profile
from test_schedule import chain_free

from hybridflow.simulator.calibration.fit import calibrate
from hybridflow.simulator.calibration.measured_terms import alone_speedup
from hybridflow.simulator.calibration.profile import ProfilePoint
from hybridflow.simulator.schedule.dataflow import DRIVER
from hybridflow.simulator.schedule.neighbours import node_share
from hybridflow.simulator.schedule.schedule import schedule, schedule_shared
from hybridflow.simulator.vocabulary.plan import Device

S = 1.6  # alone speedup of the hand-made cases


def alone_points(pairs):
    """(op, batch, seconds alone, seconds with both devices busy) → the probe's two points per job."""
    out = []
    for op, batch, alone, busy in pairs:
        for size, s in ((1, alone), (2, busy)):
            out.append(ProfilePoint(op="alone", mode=op, model="tiny", batch=batch, prompt_len=8, response_len=8,
                                    group_size=size, seconds=s))
    return out


def test_the_fit_takes_the_median_busy_over_alone_ratio():
    # ratios 1.5, 2.0, 1.25: the median 1.5; the rest of the fit is untouched
    points = alone_points([("train", 8, 0.10, 0.15), ("forward", 8, 0.02, 0.04), ("generate", 4, 0.08, 0.10)])
    profile = synthetic_profile()
    cal = calibrate(profile.model_copy(update={"points": [*profile.points, *points]}))
    assert cal.overheads.alone_speedup == pytest.approx(1.5)
    assert cal.terms == calibrate(profile).terms
    assert calibrate(profile).overheads.alone_speedup == 1.0  # no alone points: as before
    # a device alone measured slower (noise): no speedup, never a slowdown
    assert alone_speedup(profile.model_copy(update={"points": alone_points([("train", 8, 0.11, 0.10)])})) == 1.0


def two_devices(groups=(("G0", 0), ("G1", 1))):
    return node_share(S, {g: [Device(node=0, index=i)] for g, i in groups}, devices_per_node=2)


def test_two_groups_taking_turns_run_at_the_alone_speed():
    g = chain_free(["a", "b"])
    g.add_edge("a", "b")
    t = schedule_shared(g, {"a": "G0", "b": "G1"}, {"a": 2.0, "b": 1.0}, share=two_devices())
    assert t["a"] == pytest.approx((0.0, 2.0 / S)) and t["b"] == pytest.approx((2.0 / S, 3.0 / S))


def test_two_groups_working_together_run_at_the_busy_speed():
    g = chain_free(["a", "b"])
    t = schedule_shared(g, {"a": "G0", "b": "G1"}, {"a": 1.0, "b": 1.0}, share=two_devices())
    assert t == {"a": (0.0, 1.0), "b": (0.0, 1.0)}


def test_a_partial_overlap_runs_at_the_mix():
    # b (1 s) runs beside a's first second, then a finishes alone: 2 = 1 + (d - 1) * S
    g = chain_free(["a", "b"])
    t = schedule_shared(g, {"a": "G0", "b": "G1"}, {"a": 2.0, "b": 1.0}, share=two_devices())
    assert t["b"] == pytest.approx((0.0, 1.0))
    assert t["a"] == pytest.approx((0.0, 1.0 + 1.0 / S))


def test_a_group_filling_its_node_the_driver_and_a_broadcast_keep_the_busy_speed():
    g = chain_free(["a", "d", "bc"])
    g.add_edge("a", "d")
    g.add_edge("d", "bc")
    share = node_share(S, {"all": [Device(node=0, index=0), Device(node=0, index=1)]}, devices_per_node=2)
    lanes = {"a": "all", "d": DRIVER, "bc": "all"}
    secs = {"a": 1.0, "d": 0.5, "bc": 0.25}
    assert schedule_shared(g, lanes, secs, share=share) == schedule(g, lanes, secs)
    # a weight broadcast holds both single-device groups: its node is all busy
    lanes2 = {"a": "G0", "d": DRIVER, "bc": ("G0", "G1")}
    t = schedule_shared(g, lanes2, secs, share=two_devices())
    assert t["a"] == pytest.approx((0.0, 1.0 / S))
    assert t["bc"][1] - t["bc"][0] == pytest.approx(0.25)


def test_groups_on_other_nodes_are_not_neighbours():
    share = node_share(S, {"G0": [Device(node=0, index=0)], "G1": [Device(node=1, index=0)]}, devices_per_node=2)
    g = chain_free(["a", "b"])
    t = schedule_shared(g, {"a": "G0", "b": "G1"}, {"a": 1.0, "b": 1.0}, share=share)
    assert t["a"] == pytest.approx((0.0, 1.0 / S)) and t["b"] == pytest.approx((0.0, 1.0 / S))


def test_factor_one_is_the_schedule_of_today():
    assert node_share(1.0, {"G0": [Device(node=0, index=0)]}, devices_per_node=2) is None
    g = nx.gn_graph(30, seed=3).reverse()
    for i, n in enumerate(nx.topological_sort(g)):
        g.nodes[n]["order"] = i
    lanes = {n: f"G{n % 2}" for n in g}
    secs = {n: 0.1 + (n % 7) * 0.05 for n in g}
    assert schedule_shared(g, lanes, secs, share=None) == schedule(g, lanes, secs)
    shared = schedule_shared(g, lanes, secs, share=two_devices())
    assert max(e for _, e in shared.values()) < max(e for _, e in schedule(g, lanes, secs).values())
    assert all(math.isfinite(s) and e >= s for s, e in shared.values())
