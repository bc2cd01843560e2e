"""LoRA in the search: exact against brute force, priced as `simulate` prices the plan, and `search --lora`
comparing against full fine-tuning (planner/lora.py)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_util import SMALL_WORKLOAD, assert_search_is_exact, small_cluster, small_model

from hybridflow.planner.lora import compare_lora, full_finetune
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search
from hybridflow.simulator import ClusterSpec, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.vocabulary.lora import LoraConfig
from hybridflow.tools.cli import main


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([1, 2, 4]), width=st.integers(1, 6), shape=st.sampled_from([(1, 2), (1, 4), (2, 2)]),
       gib=st.sampled_from([1.6, 2.0, 3.0, 6.0]), rank=st.sampled_from([1, 8, 64]),
       algo=st.sampled_from(["ppo", "grpo", "rloo"]), mini=st.sampled_from([1, 2]))
def test_lora_search_equals_brute_force(layers, width, shape, gib, rank, algo, mini):
    m = small_model(layers=layers, hidden=256 * width, heads=4, kv_heads=2, ffn=768 * width, vocab=4000)
    wl = SMALL_WORKLOAD.model_copy(update={"mini_batches": mini,
                                           "samples_per_prompt": 4 if algo in ("grpo", "rloo") else 1})
    req = SearchRequest.for_algorithm(algo, m, small_cluster(*shape, gib=gib), wl, top_k=3, lora=LoraConfig(rank=rank))
    assert "ref" not in req.models
    found = assert_search_is_exact(req, CostModel(req.cluster))
    for s in found.top:
        assert scored_to_plan(req, s).validate_parallel().roles["actor"].lora == req.lora


def test_lora_fits_where_full_fine_tuning_does_not():
    m = small_model()
    req = SearchRequest.for_algorithm("grpo", m, small_cluster(1, 2, gib=2.0), SMALL_WORKLOAD, lora=LoraConfig(rank=8))
    cm = CostModel(req.cluster)
    assert search(full_finetune(req), cm).best is None
    assert search(req, cm).best is not None
    assert "ref" in full_finetune(req).models and full_finetune(req).lora is None


def test_request_refusals():
    m = small_model()
    with pytest.raises(ValueError, match="drop the 'ref' model"):
        SearchRequest(algorithm="grpo", models={"actor": m, "ref": m}, cluster=small_cluster(), reward_function="a:b",
                      lora=LoraConfig())
    with pytest.raises(ValueError, match="fsdp backend only"):
        SearchRequest(algorithm="grpo", models={"actor": m}, cluster=small_cluster(), reward_function="a:b",
                      lora=LoraConfig(), backends=("megatron",))


@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["a100-80g", "h100-80g"])
def test_70b_grpo_lora_needs_fewer_devices_than_full_fine_tuning(gpu):
    c = ClusterSpec(hardware=hardware_preset(gpu), nodes=4, devices_per_node=8)
    req = SearchRequest.for_algorithm("grpo", model_preset("llama2-70b"), c, Workload(), reward_function="m:f",
                                      lora=LoraConfig(rank=16))
    full, lora = compare_lora(req)
    assert full.smallest is not None and lora.smallest is not None
    assert lora.smallest.num_devices * 4 <= full.smallest.num_devices
    plan, _ = lora.smallest_plan
    assert "ref" not in plan.roles and plan.roles["actor"].lora.rank == 16
    assert "ref" in full.smallest_plan[0].roles


def test_cli_search_lora_prints_both(capsys):
    argv = ["search", "--gpu", "a100-80g", "--nodes", "1", "--model", "llama2-7b", "--algo", "grpo", "--batch", "64",
            "--prompt-len", "256", "--response-len", "256", "--samples", "4", "--lora", "8"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["parallel"]["actor"]["lora"]["rank"] == 8
    assert out["best"]["parallel"]["actor"]["lora"]["rollout"] == "merged"
    names = [v["name"] for v in out["lora"]]
    assert names == ["full fine-tune", "LoRA rank 8"]
    full, lora = out["lora"]
    assert lora["smallest_cluster"]["devices"] <= full["smallest_cluster"]["devices"]
    assert main(argv) == 0
    assert "LoRA against full fine-tuning" in capsys.readouterr().out
    assert main([*argv[:-2], "--ref", "llama2-7b", "--lora", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop --ref or --lora" in err[0]
    assert main([*argv[:-1], "0"]) == 2
