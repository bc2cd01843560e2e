"""Searching for a distribution of response lengths: exact against brute force, `simulate` agreeing with
the search, and `hflow-plan search --response-lengths` from the command line."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_util import assert_search_is_exact, small_cluster, small_model

from hybridflow.planner.request import SearchRequest
from hybridflow.simulator import Workload
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.tools.cli import main

TAILS = [{"quantiles": {0.0: 16, 0.5: 64, 0.9: 256, 1.0: 1024}}, {"quantiles": {0.5: 200, 1.0: 400}},
         {"observed": [30, 60, 90, 500]}]


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.sampled_from([2, 4]), width=st.integers(1, 4), shape=st.sampled_from([(1, 2), (1, 4), (2, 2)]),
       gib=st.sampled_from([1.2, 2.0, 6.0]), algo=st.sampled_from(["ppo", "grpo"]), tail=st.sampled_from(TAILS))
def test_search_equals_brute_force_with_response_lengths(layers, width, shape, gib, algo, tail):
    cluster = small_cluster(*shape, gib=gib)
    wl = Workload(prompts=32, prompt_len=128, micro_batch_size=2, response_lengths=tail,
                  samples_per_prompt=4 if algo == "grpo" else 1)
    actor = small_model(layers=layers, hidden=256 * width, heads=4, kv_heads=2, ffn=768 * width, vocab=4000)
    assert_search_is_exact(SearchRequest.for_algorithm(algo, actor, cluster, wl, top_k=2), CostModel(cluster))


def test_cli_prices_the_distribution_and_refuses_a_bad_one(tmp_path, capsys):
    base = ["search", "--gpu", "h100-80g", "--model", "qwen2.5-7b", "--algo", "grpo", "--batch", "64", "--samples",
            "8", "--prompt-len", "512", "--micro-batch", "1", "--top", "1", "--json"]
    assert main([*base, "--response-lengths", "p50=1000,p90=3000,max=8000"]) == 0
    tail = json.loads(capsys.readouterr().out)["best"]["iteration_seconds"]
    assert main([*base, "--response-len", "8000"]) == 0
    longest = json.loads(capsys.readouterr().out)["best"]["iteration_seconds"]
    assert tail < longest / 2
    spec = tmp_path / "lengths.yaml"
    spec.write_text("histogram:\n  lengths: [1000, 3000, 8000]\n  counts: [50, 40, 10]\n")
    assert main([*base, "--response-lengths", str(spec)]) == 0
    capsys.readouterr()
    for bad in ("p50=100", "p50=300,max=100", "max=abc"):
        assert main([*base, "--response-lengths", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--response-lengths" in err[0]
    assert main([*base, "--response-lengths", "max=9000", "--response-len", "8000"]) == 2
    assert "beyond response_len 8000" in capsys.readouterr().err


def test_a_metrics_file_without_lengths_or_not_json_is_one_line(tmp_path, capsys):
    base = ["search", "--model", "llama2-7b", "--top", "1"]
    old = tmp_path / "old.jsonl"
    old.write_text('{"iteration": 1, "reward_mean": 0.5}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    for path, msg in ((old, "records no response lengths"), (bad, "line 1 is not JSON"),
                      (tmp_path / "none.jsonl", "no file")):
        assert main([*base, "--response-lengths", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0]
