"""With a cost model whose devices run faster while their neighbours idle (alone_speedup, simulator/
neighbours.py) the search still ranks plans at what `simulate` prices and equals brute force."""

import math

import pytest
from planner_util import SMALL_WORKLOAD, small_cluster, small_model

from hybridflow.planner.brute import brute_force
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.scored import Rollout
from hybridflow.planner.search import search
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.schedule.schedule import simulate

ALONE = EngineOverheads(dispatch_seconds=0.02, queued_call_seconds=0.01, call_seconds=0.001, alone_speedup=1.6)


def _request(algorithm, per):
    return SearchRequest.for_algorithm(algorithm, small_model(layers=2, hidden=256, heads=4, kv_heads=2, ffn=704),
                                       small_cluster(1, per, gib=24.0), SMALL_WORKLOAD, max_pp=1, top_k=4)


@pytest.mark.parametrize("algorithm,per,rollout", [("ppo", 2, Rollout()), ("grpo", 2, Rollout(separate=True)),
                                                   ("grpo", 2, Rollout(mode="one-step-off", staleness=1, separate=True)),
                                                   ("ppo", 4, Rollout()), ("grpo", 4, Rollout(separate=True))])
def test_search_with_the_alone_speed_prices_as_simulate_and_equals_brute_force(algorithm, per, rollout):
    req = _request(algorithm, per)
    cm = ProfiledCostModel(req.cluster, overheads=ALONE)
    found = search(req, cm, rollout=rollout)
    assert found.top
    for s in found.top:
        simulated = simulate(scored_to_plan(req, s), cm).iteration_seconds()
        assert math.isclose(s.seconds, simulated, rel_tol=1e-9), (s.placement, s.seconds, simulated)
    ref = brute_force(req, cm, rollout)
    assert math.isclose(found.best.seconds, ref.seconds, rel_tol=1e-9), (found.best, ref)
    busy = search(req, ProfiledCostModel(req.cluster, overheads=ALONE.model_copy(update={"alone_speedup": 1.0})),
                  rollout=rollout)
    assert found.best.seconds <= busy.best.seconds
