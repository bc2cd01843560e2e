"""Sequence parallelism searched: exact against brute force for long sequences, the long-context plan that
fits only with sp, which `run` accepts (with pp = 1)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_util import assert_search_is_exact, small_cluster, small_model

from hybridflow.planner.configs import train_configs
from hybridflow.planner.request import SearchRequest
from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import Workload, model_preset
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.tools.cli import main


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 3), shape=st.sampled_from([(1, 2), (1, 4), (2, 2)]), gib=st.sampled_from([2.0, 4.0, 12.0]),
       algo=st.sampled_from(["ppo", "grpo"]), seq=st.sampled_from([4096, 8192]))
def test_search_with_sp_equals_brute_force(width, shape, gib, algo, seq):
    cluster = small_cluster(*shape, gib=gib)
    wl = Workload(prompts=8, prompt_len=512, response_len=seq - 512, micro_batch_size=2, mini_batches=1,
                  samples_per_prompt=2 if algo == "grpo" else 1)
    actor = small_model(layers=2, hidden=256 * width, heads=4, kv_heads=4, ffn=768 * width, vocab=4000)
    assert_search_is_exact(SearchRequest.for_algorithm(algo, actor, cluster, wl, top_k=2), CostModel(cluster))


LLAMA_32K = ["search", "--gpu", "h100-80g", "--model", "llama3.1-8b", "--algo", "grpo", "--batch", "32", "--samples",
             "8", "--prompt-len", "1024", "--response-len", "31744", "--micro-batch", "4", "--top", "1"]


def test_a_32k_workload_on_8_h100_fits_only_with_sequence_parallelism(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*LLAMA_32K, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sp_comm" in text  # the all-to-all in the breakdown
    plan = json.loads(out.read_text())
    assert max(r["train"].get("sp", 1) for r in plan["roles"].values()) >= 2
    assert main([*LLAMA_32K, "--max-sp", "1"]) == 2
    assert "does not fit" in capsys.readouterr().err
    from hybridflow.simulator import Plan

    check_runnable(Plan.model_validate(plan), RunConfig())  # the FSDP engine runs Ulysses (pp = 1)
    actor = next(r for r in plan["roles"].values() if r["train"].get("sp", 1) > 1)
    dp = actor["train"]["dp"] // 2
    actor["train"] |= {"pp": 2, "dp": dp, "sp": min(actor["train"]["sp"], dp)}
    with pytest.raises(HflowError, match="plan with --max-sp 1 or --max-pp 1"):
        check_runnable(Plan.model_validate(plan), RunConfig())
    # and the search proposes no such layout (planner/configs.py: sp only at pp = 1)
    assert all(c.sp == 1 for c in train_configs(model_preset("llama3.1-8b"), 8, 8, sequence_parallel=True) if c.pp > 1)


def test_short_sequences_are_searched_without_sp(capsys):
    assert main(["search", "--model", "llama2-7b", "--top", "3", "--json"]) == 0
    top = json.loads(capsys.readouterr().out)["top"]
    assert all("sp" not in cfg["train"] for t in top for cfg in t["parallel"].values())
