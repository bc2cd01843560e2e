"""With a profiled cost model the search ranks plans by what `simulate` prices: the single
controller's call gaps included (schedule.call_gaps), and still equal to brute force."""

import math

import pytest
from planner_util import SMALL_WORKLOAD, small_cluster, small_model

from hybridflow.planner.brute import brute_force
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.schedule.schedule import simulate

GAPS = EngineOverheads(dispatch_seconds=0.05, queued_call_seconds=0.02, call_seconds=0.001)


def _request(algorithm="ppo", per=2):
    return SearchRequest.for_algorithm(algorithm, small_model(layers=2, hidden=256, heads=4, kv_heads=2, ffn=704),
                                       small_cluster(1, per, gib=24.0), SMALL_WORKLOAD, max_pp=1, top_k=4)


@pytest.mark.parametrize("algorithm,per", [("ppo", 2), ("grpo", 2), ("ppo", 4)])
def test_search_prices_every_listed_plan_as_simulate_does(algorithm, per):
    req = _request(algorithm, per)
    cm = ProfiledCostModel(req.cluster, overheads=GAPS)
    found = search(req, cm)
    assert found.top
    for s in found.top:
        simulated = simulate(scored_to_plan(req, s), cm).iteration_seconds(0)
        assert math.isclose(s.seconds, simulated, rel_tol=1e-9), (s.placement, s.seconds, simulated)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_search_with_gaps_equals_brute_force(algorithm):
    req = _request(algorithm)
    cm = ProfiledCostModel(req.cluster, overheads=GAPS)
    found, ref = search(req, cm).best, brute_force(req, cm)
    assert math.isclose(found.seconds, ref.seconds, rel_tol=1e-9), (found, ref)


def test_gaps_change_the_price_and_the_pick():
    req = _request("ppo")
    cm = ProfiledCostModel(req.cluster, overheads=GAPS)
    gapless = search(req, ProfiledCostModel(req.cluster, overheads=GAPS.model_copy(
        update={"dispatch_seconds": 0.0, "queued_call_seconds": 0.0}))).best
    with_gaps = search(req, cm).best
    # at least a dispatch after generation and one before the updates
    assert with_gaps.seconds >= gapless.seconds + 2 * GAPS.dispatch_seconds
    # ranked without them, the pick is one that pays more gaps than the best plan does
    assert simulate(scored_to_plan(req, gapless), cm).iteration_seconds(0) > with_gaps.seconds * 1.05


@pytest.mark.parametrize("mode,k", [("sync", 0), ("one-step-off", 1), ("async", 2)])
def test_a_rollout_on_devices_of_its_own_is_a_call_after_the_weight_sync(mode, k):
    """The hybrid engine generates inside its reshard's call; on rollout devices of their own the rollout is a call
    of its own, dispatched after the weight sync (the async mode's second call queued behind the first), and the
    search still prices every listed plan as `simulate` does."""
    from hybridflow.planner.scored import Rollout

    req = _request("grpo", 4)
    cm = ProfiledCostModel(req.cluster, overheads=GAPS)
    found = search(req, cm, rollout=Rollout(mode, k, separate=True))
    assert found.top
    for s in found.top:
        plan = scored_to_plan(req, s)
        timeline = simulate(plan, cm, iterations=3)
        assert math.isclose(s.seconds, timeline.iteration_seconds(), rel_tol=1e-9)
        for it in timeline.iterations():
            syncs = [e for e in timeline.events if e.op == "weight_sync" and e.iteration == it]
            gens = [e for e in timeline.events if e.op == "generate" and e.iteration == it]
            for sync in syncs:  # the rollout right after a sync starts no sooner than a dispatch later
                after = [g for g in gens if g.start >= sync.end - 1e-12]
                assert all(g.start >= sync.end + GAPS.dispatch_seconds - 1e-9 for g in after)
        gen = next(e for e in timeline.events if e.op == "generate")
        assert ("dispatch" in gen.breakdown) == (mode == "async")  # the second call's queued gap
