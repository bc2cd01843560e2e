"""The async-modes benchmark without running it (the runs are tested in tests/runtime/rl/modes/test_disaggregated.py):
its four plans are runnable and priced, one step off predicted faster on the same devices; its helpers by
hand; bad input is one line."""

import pytest

from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.calibration.fit import calibrate_file
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.tools.bench import async_modes as bench


def test_four_plans_on_the_same_two_devices_priced():
    cal = calibrate_file("cpu-2core")
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    plans = bench.bench_plans(cluster.model_dump())
    assert list(plans) == ["sync colocated", "sync disaggregated", "one-step-off", "async"]
    assert plans["async"].staleness == bench.ASYNC_STALENESS
    for plan in plans.values():
        check_runnable(plan, RunConfig())
        assert sorted((d.node, d.index) for g in plan.groups for d in g.devices) == [(0, 0), (0, 1)]
    cm = cal.cost_model(cluster)
    seconds = {n: simulate(p, cm, iterations=3).iteration_seconds() for n, p in plans.items()}
    assert seconds["one-step-off"] < seconds["sync disaggregated"]


def test_helpers_by_hand():
    assert bench.thirds([0.1, 0.2, 0.3, 0.4, 0.5, 0.9]) == (pytest.approx(0.15), pytest.approx(0.7))
    runs = [{"seconds": s, "id": i} for i, s in enumerate([0.30, 0.22, 0.26])]
    assert bench.median_run(runs)["id"] == 2
    assert bench.median_run(runs[:2])["id"] == 1  # even count: the lower middle
    assert bench.median_run(runs[:1])["id"] == 0


def test_bad_input_is_one_line():
    with pytest.raises(HflowError, match="at least 3"):
        bench.main(["--iterations", "2"])
    with pytest.raises(HflowError, match="unknown plan 'asink'"):
        bench.main(["--only", "asink"])
    with pytest.raises(HflowError, match="--repeats 0"):
        bench.main(["--repeats", "0"])


def test_sides_weigh_the_rollout_against_the_trainers():
    cal = calibrate_file("cpu-2core")
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    plan = bench.bench_plans(cluster.model_dump())[bench.BALANCE_PLAN]
    tl = simulate(plan, cal.cost_model(cluster), iterations=3)
    rollout, trainers = bench.sides(tl, plan)
    ops = tl.op_seconds()
    assert rollout == pytest.approx(ops["generate"])
    assert trainers == pytest.approx(ops["ref_logprob"] + ops["actor_update"])  # the sync (both sides) in neither


def test_speedups_over_sync_colocated_and_over_sync_on_the_same_split():
    rows = [{"plan": "sync colocated", "measured": 0.8}, {"plan": "sync disaggregated", "measured": 1.0},
            {"plan": "one-step-off", "measured": 0.5}]
    bench.add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 0.8, 1.6]
    assert [r["speedup_same_split"] for r in rows] == [None, 1.0, 2.0]
    alone = [{"plan": "one-step-off", "measured": 0.5}]  # --only: the references were not run
    bench.add_speedups(alone)
    assert alone[0]["speedup"] is None and alone[0]["speedup_same_split"] is None


def test_balance_is_said_in_words():
    assert bench.balance_word(0.2, 0.75) == "training-bound"
    assert bench.balance_word(0.6, 0.75) == "comparable"
    assert bench.balance_word(1.2, 0.75) == "rollout-bound"
