"""tools/bench/published.py: the op tier of the published dataset priced end to end in a subprocess (its JSON,
its target met, no torch), and the summary and orders it reports, on hand-made rows."""

import json
import subprocess
import sys

import pytest

from hybridflow.simulator.calibration.published import load_published
from hybridflow.tools.bench import published as bench


@pytest.fixture(scope="module")
def op_tier():
    proc = subprocess.run([sys.executable, "-m", "hybridflow.tools.bench.published", "--tier", "op", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_op_tier_meets_its_target_without_torch(op_tier):
    s = op_tier["summary"]
    assert set(s) == {"op"}  # --tier op: no system point priced
    op = s["op"]
    assert op["met"] is True and op["target"] == 0.15
    assert op["median_abs_error"] is not None and op["median_abs_error"] <= 0.15
    assert op["unpriced"] == []
    assert op_tier["torch_imported"] is False
    assert op_tier["orders"] == []  # every order compares system-tier points
    assert op_tier["seconds"] > 0


def test_every_op_point_with_a_setup_is_priced(op_tier):
    dataset = {p.id: p for p in load_published() if p.tier == "op" and p.setup is not None}
    rows = op_tier["points"]
    assert [r["id"] for r in rows] == list(dataset)  # in the dataset's order, each once
    assert op_tier["summary"]["op"]["points"] == len(dataset) > 0
    for r in rows:
        p = dataset[r["id"]]
        assert r["tier"] == "op" and r["kind"] == p.kind and r["unit"] == p.measured.unit
        assert r["measured"] == pytest.approx(p.measured.value * p.setup.unit_scale)
        assert r["predicted"] is not None and r["predicted"] > 0, r
        assert r["error"] == pytest.approx((r["predicted"] - r["measured"]) / r["measured"])
    errors = sorted(abs(r["error"]) for r in rows)
    n = len(errors)
    median = errors[n // 2] if n % 2 else (errors[n // 2 - 1] + errors[n // 2]) / 2
    assert op_tier["summary"]["op"]["median_abs_error"] == pytest.approx(median)


# ---- summary and orders on hand-made rows -------------------------------------------------------------------
def row(id_, tier, measured, predicted):
    error = None if predicted is None else (predicted - measured) / measured
    return {"id": id_, "tier": tier, "kind": "k", "unit": "s", "measured": measured, "predicted": predicted,
            "error": error}


def test_summary_medians_and_the_points_off_by_more_than_2x():
    rows = [
        row("op-a", "op", 100.0, 110.0),  # +10 %
        row("op-b", "op", 100.0, 88.0),  # -12 %
        row("op-c", "op", 100.0, 105.0),  # +5 %
        row("op-d", "op", 100.0, 250.0),  # +150 %: over 2x
        row("sys-a", "system", 10.0, 11.0),  # +10 %
        row("sys-b", "system", 10.0, 8.0),  # -20 %
        row("sys-c", "system", 10.0, 10.0),  # 0
        row("sys-d", "system", 10.0, 5.0),  # -50 %: exactly half, not off by more than 2x
        row("sys-e", "system", 10.0, 20.0),  # +100 %: exactly twice, not off by more than 2x
    ]
    s = bench.summary(rows)
    assert s["op"]["points"] == 4 and s["system"]["points"] == 5
    assert s["op"]["median_abs_error"] == pytest.approx(0.11)  # |errors| 0.05, 0.10, 0.12, 1.5
    assert s["op"]["off_by_2x"] == ["op-d"]
    assert s["op"]["met"] is True  # the op target is the median alone
    assert s["system"]["median_abs_error"] == pytest.approx(0.2)  # 0, 0.1, 0.2, 0.5, 1.0
    assert s["system"]["off_by_2x"] == [] and s["system"]["met"] is True
    assert (s["op"]["target"], s["system"]["target"]) == (0.15, 0.25)

    # a system point under half its figure: the system tier is not met, whatever its median
    worse = bench.summary([*rows, row("sys-f", "system", 10.0, 4.9)])
    assert worse["system"]["off_by_2x"] == ["sys-f"] and worse["system"]["met"] is False
    assert worse["system"]["median_abs_error"] == pytest.approx(0.35)  # 0, 0.1, 0.2, 0.5, 0.51, 1.0

    # a point that could not be priced is listed and fails its tier
    failed = bench.summary([*rows, {**row("op-x", "op", 1.0, None), "why": "no fit"}])
    assert failed["op"]["unpriced"] == ["op-x"] and failed["op"]["met"] is False
    assert failed["op"]["points"] == 4 and failed["op"]["median_abs_error"] == pytest.approx(0.11)

    # a median over the target fails it; a tier without rows is left out
    only_op = bench.summary([row("op-a", "op", 1.0, 1.2), row("op-b", "op", 1.0, 0.8)])
    assert set(only_op) == {"op"} and only_op["op"]["median_abs_error"] == pytest.approx(0.2)
    assert only_op["op"]["met"] is False
    assert bench.summary([]) == {}
    nothing_priced = bench.summary([row("sys-x", "system", 1.0, None)])
    assert nothing_priced["system"]["median_abs_error"] is None and nothing_priced["system"]["met"] is False


def test_orders_compare_the_published_and_predicted_rankings(monkeypatch):
    monkeypatch.setattr(bench, "ORDERS", {
        "same order": ["w1-slow", "w1-fast", "w1-mid"],
        "two swapped": ["w2-a", "w2-b", "w2-c"],
        "one unpriced": ["w3-a", "w3-b"],
        "one missing": ["w4-a", "w4-b"],
    })
    rows = [
        row("w1-slow", "system", 30.0, 45.0), row("w1-fast", "system", 10.0, 7.0), row("w1-mid", "system", 20.0, 21.0),
        row("w2-a", "system", 1.0, 1.0), row("w2-b", "system", 2.0, 3.5), row("w2-c", "system", 3.0, 3.0),
        row("w3-a", "system", 1.0, 1.0), row("w3-b", "system", 2.0, None),
        row("w4-a", "system", 1.0, 1.0),
    ]
    got = bench.orders(rows)
    assert got == [
        {"workload": "same order", "published": ["w1-fast", "w1-mid", "w1-slow"],
         "predicted": ["w1-fast", "w1-mid", "w1-slow"], "same": True},
        {"workload": "two swapped", "published": ["w2-a", "w2-b", "w2-c"],
         "predicted": ["w2-a", "w2-c", "w2-b"], "same": False},
    ]  # a workload with a point unpriced or absent is left out


def test_the_orders_name_system_points_of_the_dataset():
    points = {p.id: p for p in load_published()}
    for title, ids in bench.ORDERS.items():
        assert len(ids) >= 2, title
        for i in ids:
            assert i in points, f"{title}: {i}"
            assert points[i].tier == "system" and points[i].setup is not None, i
