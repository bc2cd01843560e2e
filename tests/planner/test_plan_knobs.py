"""The knobs a searched plan carries for `run`: the rollout engine's memory share and concurrent sequences
are what its generation was priced with, and `search` prints them."""

from hybridflow.planner import search
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator import Workload
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.cost import CostModel, rollout_knobs
from hybridflow.simulator.pricing.plan_memory import kv_free_bytes
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import model_preset
from hybridflow.simulator.vocabulary.units import BF16, GiB
from hybridflow.tools.cli import main


def _plan(prompts: int):
    cluster = ClusterSpec(hardware=hardware_preset("h100-80g"), nodes=1, devices_per_node=8)
    req = SearchRequest.for_algorithm("grpo", model_preset("qwen2.5-7b"), cluster,
                                      Workload(prompts=prompts, prompt_len=1024, response_len=2048,
                                               samples_per_prompt=8, micro_batch_size=1), top_k=1)
    result = search(req, CostModel(cluster))
    return scored_to_plan(req, result.best)


def test_the_rollout_knobs_are_the_priced_kv_batch_and_memory():
    for prompts in (16, 512):  # the KV cache holds every sequence; then it does not
        plan = _plan(prompts)
        actor, gen, w = plan.roles["actor"], plan.generation_config(), plan.workload
        free = kv_free_bytes(plan)
        _, batch = generation.decode_slots(CostModel(plan.cluster), actor.model, gen, w, w.sequences, free)
        assert actor.max_concurrent_sequences == batch == rollout_knobs(plan)["max_concurrent_sequences"]
        weights = BF16 * actor.model.num_params("lm") / (gen.tp * gen.pp)
        share = actor.rollout_memory_fraction * 80 * GiB
        # the engine's weights and the room the states leave it (the KV cache and its logits), rounded up so that
        # the plan's knob, which caps the KV cache it is priced with, leaves that room whole (the batch above)
        assert free + weights <= share < free + weights + 0.01 * 80 * GiB
        if prompts == 16:  # every sequence of a replica at once
            assert actor.max_concurrent_sequences == -(-w.sequences // gen.dp)
        else:  # the KV cache is the bound
            assert actor.max_concurrent_sequences < -(-w.sequences // gen.dp)


def test_search_prints_the_knobs(capsys):
    assert main(["search", "--gpu", "h100-80g", "--model", "qwen2.5-7b", "--algo", "grpo", "--batch", "64",
                 "--samples", "8", "--prompt-len", "512", "--response-lengths", "mean=2000,max=8000",
                 "--micro-batch", "1", "--top", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "best plan's knobs (`run` uses them): micro-batch token budget actor" in out
    assert "rollout memory fraction 0." in out and "sequences decoded at once per replica" in out
    # beside it, what a search of fixed lengths at the longest response picks, slower, and its own knobs
    assert "if every response were the longest, 8,000 tokens: the plan a fixed-length search picks" in out
    assert "its knobs: micro-batch 1 rows" in out


def test_search_json_carries_the_plan_at_the_longest(capsys):
    import json

    args = ["search", "--gpu", "h100-80g", "--model", "qwen2.5-7b", "--algo", "grpo", "--batch", "64",
            "--samples", "8", "--prompt-len", "512", "--micro-batch", "1", "--top", "1", "--json"]
    assert main(args + ["--response-lengths", "mean=2000,max=8000"]) == 0
    tail = json.loads(capsys.readouterr().out)
    assert main(args + ["--response-len", "8000"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert tail["at_longest"] == fixed["best"]  # the same search as one asked at fixed lengths
    assert tail["at_longest"]["iteration_seconds"] > tail["best"]["iteration_seconds"]
