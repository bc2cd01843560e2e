"""The planner searches expert parallelism: a MoE model trained by Megatron takes every ep dividing dp and its
experts, priced and fitted by the same functions as any layout; the search stays exact against brute force
and picks ep > 1 where nothing fits without it."""

import math

import pytest
from planner_util import SMALL_WORKLOAD, small_cluster, small_model, small_moe

from hybridflow.planner.brute import all_plans, brute_force
from hybridflow.planner.configs import train_configs
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.schedule.schedule import simulate


def test_ep_is_enumerated_for_moe_models_on_megatron_only():
    moe = small_moe()
    both = train_configs(moe, 8, 8, backends=("fsdp", "megatron"))
    assert all(c.ep == 1 for c in both if c.backend == "fsdp")
    meg: dict[tuple, list[int]] = {}
    for c in both:
        if c.backend == "megatron":
            meg.setdefault((c.pp, c.tp, c.dp), []).append(c.ep)
    assert meg[(1, 1, 8)] == [1, 2, 4] and meg[(1, 2, 4)] == [1, 2, 4] and meg[(2, 2, 2)] == [1, 2]  # ep | dp, ep | 4
    assert all(not c.problems(moe) for c in both)
    dense = train_configs(small_model(), 8, 8, backends=("fsdp", "megatron"))
    assert all(c.ep == 1 for c in dense) and len(dense) == 2 * len(train_configs(small_model(), 8, 8))


# gib: the least memory (0.1 GiB steps) on which each case's best plan splits experts, where memory binds hardest
# (PPO's two trained models keep their Megatron gradient buffers resident: on 1.9 GiB its best plan is two
# pipeline stages of one replica, where ep, a divisor of dp, is 1)
@pytest.mark.parametrize("algo,shape,gib", [("grpo", (1, 4), 1.9), ("grpo", (2, 2), 1.9), ("ppo", (1, 4), 2.0)])
def test_search_with_expert_parallelism_equals_brute_force(algo, shape, gib):
    req = SearchRequest.for_algorithm(algo, small_moe(), small_cluster(*shape, gib=gib), SMALL_WORKLOAD, top_k=3,
                                      backends=("megatron",))
    cm = CostModel(req.cluster)
    found, ref = search(req, cm), brute_force(req, cm)
    assert ref is not None and math.isclose(found.best.seconds, ref.seconds, rel_tol=1e-9)
    assert any(c.train.ep > 1 for _, c in found.best.choice)  # memory binds: some role splits its experts
    for s in found.top:
        plan = scored_to_plan(req, s)
        assert all(m.fits for m in plan_memory(plan).values())
        assert math.isclose(simulate(plan, cm).iteration_seconds(), s.seconds, rel_tol=1e-9)


def test_planner_picks_ep_where_nothing_fits_without_it():
    # one layer and one kv head: tp = pp = 1, so only ep can shrink what a Megatron rank holds
    moe = small_moe(layers=1, hidden=1024, heads=4, kv_heads=1, ffn=2816, experts=8)
    req = SearchRequest.for_algorithm("grpo", moe, small_cluster(1, 4, gib=2.5), SMALL_WORKLOAD, top_k=3,
                                      backends=("megatron",))
    cm = CostModel(req.cluster)
    plans = list(all_plans(req, cm))
    assert plans and all(any(c.train.ep > 1 for _, c in p.choice) for p in plans)  # none fits at ep = 1
    best = search(req, cm).best
    assert math.isclose(best.seconds, min(p.seconds for p in plans), rel_tol=1e-9)
    plan = scored_to_plan(req, best)
    role = next(r for r, c in best.choice if c.train.ep > 1)
    rp = plan.roles[role]
    at_one = plan.model_copy(update={"roles": {**plan.roles, role: rp.model_copy(
        update={"train": rp.train.model_copy(update={"ep": 1})})}})
    assert not all(m.fits for m in plan_memory(at_one).values())
