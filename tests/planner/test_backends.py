"""`search --backends fsdp,megatron`: every layout once per training engine, chosen per role; the search
over both is exact, so its best is no slower than the best of either engine alone."""

import math

import pytest
from planner_util import SMALL_WORKLOAD, small_cluster, small_model

from hybridflow.planner.brute import _set_layouts, brute_force, price_set
from hybridflow.planner.configs import train_configs
from hybridflow.planner.placement import assign_devices
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.pricing import RolePricer
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search
from hybridflow.simulator import DeviceGroup, Plan, RolePlan
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.schedule.dataflow import build_dataflow
from hybridflow.simulator.schedule.schedule import simulate

ROLES = ("actor", "critic", "ref", "reward")


def test_train_configs_once_per_backend():
    model = small_model()
    fsdp = train_configs(model, 4, 4)
    both = train_configs(model, 4, 4, backends=("fsdp", "megatron"))
    assert len(both) == 2 * len(fsdp) and {c.backend for c in both} == {"fsdp", "megatron"}
    assert {c.generation_layout() for c in both} == set(fsdp)


def test_search_over_both_backends_is_no_worse_than_either():
    def best(backends):
        req = SearchRequest(algorithm="ppo", models=dict.fromkeys(ROLES, small_model()),
                            cluster=small_cluster(per=4, gib=16.0), workload=SMALL_WORKLOAD, backends=backends)
        return search(req).best

    fsdp, meg, both = best(("fsdp",)), best(("megatron",)), best(("fsdp", "megatron"))
    assert both.seconds <= min(fsdp.seconds, meg.seconds) + 1e-9
    assert all(c.train.backend == "megatron" for _, c in meg.choice)
    assert all(c.generate is None or c.generate.backend == "fsdp" for _, c in meg.choice + both.choice)


@pytest.mark.parametrize("algo,gib,shape", [("ppo", 2.0, (1, 4)), ("grpo", 2.5, (1, 4)), ("ppo", 3.0, (2, 2))])
def test_search_over_both_backends_equals_brute_force(algo, gib, shape):
    # Megatron keeps weights whole over dp: a set's resident bytes depend on its members' layouts, and
    # memory binds here, so this checks the per-class pricing (planner/sets.py) against every combination.
    req = SearchRequest.for_algorithm(algo, small_model(layers=2), small_cluster(*shape, gib=gib), SMALL_WORKLOAD,
                                      top_k=3, backends=("fsdp", "megatron"))
    cm = CostModel(req.cluster)
    found, ref = search(req, cm), brute_force(req, cm)
    assert (found.best is None) == (ref is None)
    if ref is not None:
        assert math.isclose(found.best.seconds, ref.seconds, rel_tol=1e-9)
        for s in found.top:
            plan = scored_to_plan(req, s)
            assert all(m.fits for m in plan_memory(plan).values())
            assert math.isclose(simulate(plan, cm).iteration_seconds(), s.seconds, rel_tol=1e-9)


def test_megatron_layouts_fit_as_the_memory_model_says():
    """Every colocated combination on 4 devices, Megatron's whole-over-dp weights included: the search's
    feasibility (brute.price_set) agrees with plan_memory on a real Plan."""
    req = SearchRequest.for_algorithm("ppo", small_model(layers=2), small_cluster(1, 4, gib=2.0), SMALL_WORKLOAD,
                                      backends=("fsdp", "megatron"))
    graph = build_dataflow("ppo", req.roles, reward_model=True, cost_model=False, hybrid_engine=True)
    rp = RolePricer(req, graph, CostModel(req.cluster))
    group = DeviceGroup(name="all", devices=assign_devices((4,), req.cluster)[0])
    layouts = list(_set_layouts(rp, req.roles, 4))
    megatron = 0
    for layout in layouts[::max(1, len(layouts) // 150)]:
        roles = {r: RolePlan(model=req.models[r], group="all", train=e[0], generate=g)
                 for r, (e, g) in zip(req.roles, layout, strict=True)}
        plan = Plan(algorithm="ppo", cluster=req.cluster, workload=req.workload, groups=[group], roles=roles)
        assert (price_set(rp, req.roles, 4, layout) is not None) == all(m.fits for m in plan_memory(plan).values())
        megatron += any(e[0].backend == "megatron" for e, _ in layout)
    assert megatron
