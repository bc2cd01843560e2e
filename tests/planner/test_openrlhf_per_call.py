"""OpenRLHF's baseline scores each generate call's batch before the rank's next call (Mechanics.score_per_call):
set on its Ray trainer's plans, with or without vLLM, not on its DeepSpeed launcher's (every model on every device),
and priced below the same plan with the scoring after the whole generation."""

import pytest

from hybridflow.planner.baselines import SystemSettings, openrlhf, openrlhf_colocated
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator import ClusterSpec, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.schedule.schedule import simulate

SPLIT = {"ref": 1, "reward": 1, "actor": 2, "critic": 2, "rollout": 2}  # OpenRLHF's 7B Ray+vLLM benchmark split


def _request():
    c = ClusterSpec(hardware=hardware_preset("a800-80g"), nodes=1, devices_per_node=8)
    req = SearchRequest.for_algorithm("ppo", model_preset("llama2-7b"), c,
                                      Workload(prompts=128, prompt_len=256, response_len=256))
    return req, CostModel(c)


def test_the_ray_trainer_scores_per_call_and_the_launcher_does_not():
    req, cm = _request()
    vllm = openrlhf(req, cm, SystemSettings(split=SPLIT, generation_batch=16))
    hf = openrlhf(req, cm, SystemSettings(vllm=False, generation_batch=8, actor_zero_stage=3))
    launcher = openrlhf_colocated(req, cm, SystemSettings(actor_zero_stage=2, generation_batch=8))
    assert vllm.fits and vllm.plan.mechanics.score_per_call
    assert hf.plan.mechanics.score_per_call
    assert not launcher.plan.mechanics.score_per_call


def test_per_call_scoring_overlaps_the_shared_reference_with_generation():
    req, cm = _request()
    b = openrlhf(req, cm, SystemSettings(split=SPLIT, generation_batch=16))
    after = b.plan.model_copy(update={"mechanics": b.plan.mechanics.model_copy(update={"score_per_call": False})})
    per_call, whole = simulate(b.plan, cm), simulate(after, cm)
    assert b.seconds == per_call.iteration_seconds() < whole.iteration_seconds()
    waited = sum(e.breakdown.get("scores_awaited", 0.0) for e in per_call.events if e.op == "generate")
    assert waited > 0  # the second rank's calls start after its wait for the shared reference and reward
    # compare's breakdown: the generate op is the engines' calls plus the waits within their rounds
    assert per_call.op_seconds()["generate"] == pytest.approx(whole.op_seconds()["generate"] + waited)
