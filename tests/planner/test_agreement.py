"""The search's own pricing agrees with the simulator's: simulate(plan) and plan_memory(plan)."""

import itertools
import math

import pytest
from planner_util import SMALL_WORKLOAD, small_cluster, small_model

from hybridflow.planner.brute import _set_layouts, price_set
from hybridflow.planner.placement import assign_devices
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.pricing import RolePricer
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import Planner, search
from hybridflow.simulator import (
    ClusterSpec,
    DeviceGroup,
    Plan,
    RolePlan,
    Workload,
    hardware_preset,
    model_preset,
)
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.schedule.dataflow import build_dataflow
from hybridflow.simulator.schedule.schedule import simulate


@pytest.mark.parametrize("algo,gib,shape", [("ppo", 24.0, (1, 4)), ("ppo", 3.0, (2, 2)), ("grpo", 2.5, (1, 4)),
                                           ("remax", 6.0, (1, 2)), ("safe-rlhf", 24.0, (1, 4))])
def test_top_plans_simulate_to_the_searched_seconds(algo, gib, shape):
    m = small_model()
    req = SearchRequest.for_algorithm(algo, m, small_cluster(*shape, gib=gib), SMALL_WORKLOAD, top_k=4)
    cm = CostModel(req.cluster)
    res = search(req, cm)
    assert res.top, "expected a plan that fits"
    for s in res.top:
        plan = scored_to_plan(req, s).validate_parallel()
        tl = simulate(plan, cm)
        assert math.isclose(tl.iteration_seconds(), s.seconds, rel_tol=1e-9)
        assert all(m.fits for m in plan_memory(plan).values())
        # the plan survives the JSON round trip that `hflow-plan simulate` reads
        again = Plan.from_json_text(plan.model_dump_json())
        assert math.isclose(simulate(again, cm).iteration_seconds(), s.seconds, rel_tol=1e-9)


@pytest.mark.parametrize("mode,k", [("sync", 0), ("one-step-off", 1), ("async", 2), ("async", 4)])
def test_separate_rollout_plans_simulate_to_the_searched_seconds(mode, k):
    """In every mode the searched seconds are `simulate`'s: the makespan, or the pipeline's period."""
    from hybridflow.planner.scored import Rollout

    wl = SMALL_WORKLOAD.model_copy(update={"samples_per_prompt": 4})
    req = SearchRequest.for_algorithm("grpo", small_model(), small_cluster(2, 4, gib=24.0), wl, top_k=3)
    cm = CostModel(req.cluster)
    res = search(req, cm, rollout=Rollout(mode, k, separate=True))
    assert res.top
    for s in res.top:
        plan = scored_to_plan(req, s).validate_parallel()
        assert plan.mode == mode and plan.staleness == k and plan.roles["actor"].generate_group
        assert len(plan.group(plan.roles["actor"].generate_group).devices) == s.rollout_devices() > 0
        assert math.isclose(simulate(plan, cm).iteration_seconds(), s.seconds, rel_tol=1e-9)
        again = Plan.from_json_text(plan.model_dump_json())
        assert math.isclose(simulate(again, cm).iteration_seconds(), s.seconds, rel_tol=1e-9)


def test_remax_with_several_samples_prices_the_greedy_pass_per_prompt():
    wl = SMALL_WORKLOAD.model_copy(update={"samples_per_prompt": 4})
    req = SearchRequest.for_algorithm("remax", small_model(), small_cluster(1, 4, gib=24.0), wl, top_k=3)
    cm = CostModel(req.cluster)
    for s in search(req, cm).top:
        assert math.isclose(simulate(scored_to_plan(req, s), cm).iteration_seconds(), s.seconds, rel_tol=1e-9)


def test_paper_scale_best_plan_agrees_with_simulate():
    c = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=4, devices_per_node=8)
    req = SearchRequest.for_algorithm("ppo", model_preset("llama2-13b"), c, Workload(), top_k=3)
    planner = Planner(req)
    res = planner.run()
    for s in res.top:
        plan = scored_to_plan(req, s)
        assert math.isclose(simulate(plan, planner.cm).iteration_seconds(), s.seconds, rel_tol=1e-9)
        assert all(m.fits for m in plan_memory(plan).values())


@pytest.mark.parametrize("gib,n,algo", [(3.0, 4, "ppo"), (2.5, 2, "grpo"), (6.0, 4, "remax"), (2.0, 4, "ppo")])
def test_every_colocated_layout_prices_and_fits_as_the_simulator_says(gib, n, algo):
    """All models on all n devices: every (train, generate) layout combination, priced by the search's
    primitives and by simulate/plan_memory on a real Plan — feasibility and seconds per op agree."""
    req = SearchRequest.for_algorithm(algo, small_model(layers=2), small_cluster(1, n, gib=gib), SMALL_WORKLOAD)
    cm = CostModel(req.cluster)
    graph = build_dataflow(algo, req.roles, reward_model=True, cost_model=False, hybrid_engine=True)
    rp = RolePricer(req, graph, cm)
    members = req.roles
    group = DeviceGroup(name="all", devices=assign_devices((n,), req.cluster)[0])
    layouts = list(_set_layouts(rp, members, n))
    fits = unfit = 0
    for layout in itertools.islice(layouts, 0, None, max(1, len(layouts) // 60)):
        roles = {r: RolePlan(model=req.models[r], group="all", train=e[0], generate=g) for r, (e, g) in
                 zip(members, layout, strict=False)}
        plan = Plan(algorithm=algo, cluster=req.cluster, workload=req.workload, groups=[group], roles=roles)
        mine = price_set(rp, members, n, layout)
        sim_fits = all(m.fits for m in plan_memory(plan).values())
        assert (mine is not None) == sim_fits, layout
        if mine is None:
            unfit += 1
            continue
        fits += 1
        tl = simulate(plan, cm)
        by_op = {(e.op, e.role): e.seconds for e in tl.events if e.role != "driver" and e.group == "all"}
        for node, secs in mine[0].items():
            a = graph.nodes[node]
            if a.get("baseline"):
                continue
            assert math.isclose(by_op[(a["op"], a["role"])], secs, rel_tol=1e-9), node
    assert fits + unfit > 0
    if gib >= 2.5:  # the roomy cases have feasible layouts to compare
        assert fits
