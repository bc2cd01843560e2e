"""The planner proposes only Megatron layouts the runtime runs (simulator/vocabulary/execution.py): colocated
Megatron roles share one (tp, pp, ep), a trained MoE model on Megatron keeps tp = 1. Every plan of the
search's top list passes check_runnable, the search still equals brute force, and the rule binds in these
cases (the unfiltered combinations include ones it refuses)."""

import itertools
import math

import pytest
from planner_util import SMALL_WORKLOAD, small_cluster, small_model, small_moe

from hybridflow.planner.brute import brute_force
from hybridflow.planner.configs import train_configs
from hybridflow.planner.diagnose import least_memory
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search
from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.vocabulary.execution import colocation_problem, megatron_state, moe_tp_problem

BOTH = ("fsdp", "megatron")
# (algorithm, model, cluster shape, GiB per device, backends): memory binds in each, so sets mix layouts
CASES = {
    "ppo-dense-both": ("ppo", small_model(layers=2), (1, 4), 2.2, BOTH),
    "grpo-dense-both": ("grpo", small_model(layers=2), (1, 4), 2.5, BOTH),
    "grpo-moe-megatron": ("grpo", small_moe(), (2, 2), 1.9, ("megatron",)),
    "ppo-moe-both": ("ppo", small_moe(), (1, 4), 1.9, BOTH),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_searched_plan_is_runnable_and_the_search_equals_brute_force(case):
    algo, model, shape, gib, backends = CASES[case]
    req = SearchRequest.for_algorithm(algo, model, small_cluster(*shape, gib=gib), SMALL_WORKLOAD, top_k=5,
                                      backends=backends)
    cm = CostModel(req.cluster)
    found, ref = search(req, cm), brute_force(req, cm)
    assert ref is not None and math.isclose(found.best.seconds, ref.seconds, rel_tol=1e-9)
    for s in found.top:
        check_runnable(scored_to_plan(req, s), RunConfig())
    # the rule binds: on the whole cluster, some pair of the roles' layouts breaks it
    n = req.cluster.num_devices
    layouts = [train_configs(model, n, shape[1], backends=backends) for _ in range(2)]
    assert any(colocation_problem("g", {"a": a, "b": b}) for a, b in itertools.product(*layouts))


def test_trained_moe_layouts_on_megatron_keep_tp_1_and_forward_only_ones_do_not():
    moe = small_moe()
    trained = train_configs(moe, 8, 8, backends=BOTH, trained=True)
    every = train_configs(moe, 8, 8, backends=BOTH)
    assert all(moe_tp_problem(moe, c) is None for c in trained)
    assert {c for c in every if c.backend == "fsdp" or c.tp == 1} == set(trained)
    assert any(c.backend == "megatron" and c.tp > 1 for c in every)  # ref and reward may take them
    assert set(train_configs(small_model(), 8, 8, backends=BOTH, trained=True)) == set(
        train_configs(small_model(), 8, 8, backends=BOTH))  # dense models are not limited
    assert {megatron_state(c) for c in trained if c.backend == "megatron"} == {  # (tp, pp, ep): ep | dp and 4
        (1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 2, 2), (1, 2, 4)}


def test_the_infeasibility_diagnosis_counts_only_layouts_the_search_takes():
    req = SearchRequest.for_algorithm("grpo", small_moe(), small_cluster(1, 4), SMALL_WORKLOAD, backends=("megatron",),
                                      max_gen_pp=1)
    _, actor = least_memory(req, "actor", 4)
    _, ref = least_memory(req, "ref", 4)
    assert "tp1" in actor and "pp2" in actor and "(gen pp1·tp1·dp4)" in actor  # trained: tp 1; generation pp 1
    assert "tp4" in ref  # forward only: tp > 1 runs
