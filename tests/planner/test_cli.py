"""`hflow-plan search` and `compare` end to end, in process (the CLI's main())."""

import json

import pytest

from hybridflow.simulator import Plan
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.tools.cli import main

SMALL = ["--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "8", "--model", "llama2-7b", "--batch", "64",
         "--prompt-len", "256", "--response-len", "256"]
SUMMARY_KEYS = {"placement", "devices", "parallel", "iteration_seconds", "tokens_per_second"}


def _json(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object on stdout


def _check_summary(s, roles):
    assert set(s) == SUMMARY_KEYS
    assert sorted(r for g in s["placement"] for r in g) == sorted(roles)
    assert set(s["devices"]) == set(roles) == set(s["parallel"])
    for role, p in s["parallel"].items():
        assert set(p) == ({"train", "generate"} if role == "actor" else {"train"})
        for cfg in p.values():  # the training engine where it is not the default (a baseline's own)
            assert set(cfg) - {"backend"} == {"pp", "tp", "dp"} and cfg.get("backend", "megatron") in (
                "megatron", "deepspeed")
            assert cfg["pp"] * cfg["tp"] * cfg["dp"] == s["devices"][role]
    assert s["tokens_per_second"] == pytest.approx(64 * 512 / s["iteration_seconds"])


def test_search_json_has_exactly_the_issue_shape(capsys):
    out = _json(capsys, ["search", *SMALL, "--algo", "ppo", "--json", "--top", "3"])
    assert set(out) == {"best", "top", "baselines", "search_seconds", "plans_priced"}
    roles = ["actor", "critic", "ref", "reward"]
    _check_summary(out["best"], roles)
    assert 1 <= len(out["top"]) <= 3 and out["top"][0] == out["best"]
    for s in out["top"]:
        _check_summary(s, roles)
    assert [s["iteration_seconds"] for s in out["top"]] == sorted(s["iteration_seconds"] for s in out["top"])
    assert set(out["baselines"]) == {"ds-chat", "openrlhf", "nemo-aligner", "hybridflow-v"}
    for name, b in out["baselines"].items():
        if b.get("fits") is False:
            assert set(b) == {"fits", "reason"} and b["reason"]
        else:
            _check_summary(b, roles)
            if name != "openrlhf":  # the others' plans are no better than some plan of our search space
                assert b["iteration_seconds"] >= out["best"]["iteration_seconds"] * (1 - 1e-9)
    assert out["plans_priced"] > 0 and out["search_seconds"] > 0


def test_out_writes_a_plan_that_simulate_reads(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    out = _json(capsys, ["search", *SMALL, "--algo", "grpo", "--samples", "4", "--json", "--out", str(plan_path),
                         "--trace", str(trace), "--timeline", str(png)])
    plan = Plan.load(plan_path)
    assert simulate(plan).iteration_seconds() == pytest.approx(out["best"]["iteration_seconds"], rel=1e-9)
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sim = _json(capsys, ["simulate", str(plan_path), "--json"])
    assert sim["iteration_seconds"] == pytest.approx(out["best"]["iteration_seconds"], rel=1e-9)
    assert sim["fits"] is True


def test_tables_mode_prints_top_plans_and_timeline(capsys):
    assert main(["search", *SMALL, "--algo", "remax", "--max-pp", "1"]) == 0
    out = capsys.readouterr().out
    assert "top plans" in out and "generate_baseline" in out and "tokens/s" in out


def test_compare_shows_each_baseline(capsys):
    out = _json(capsys, ["compare", *SMALL, "--algo", "ppo", "--json"])
    assert set(out["baselines"]) == set(out["speedup"]) == {"ds-chat", "openrlhf", "nemo-aligner", "hybridflow-v"}
    for name, sp in out["speedup"].items():
        assert sp is None or sp > 0, name
        if name != "openrlhf" and sp is not None:
            assert sp >= 1 - 1e-9, name
    assert main(["compare", *SMALL, "--algo", "ppo"]) == 0
    assert "speedup" in capsys.readouterr().out


def test_compare_with_both_backends_shows_each_engine_alone_and_the_mix(capsys):
    argv = ["compare", *SMALL, "--gpus-per-node", "4", "--algo", "grpo", "--backends", "fsdp,megatron"]
    out = _json(capsys, [*argv, "--json"])
    choices = out["backends"]
    assert list(choices) == ["fsdp", "megatron", "fsdp,megatron"]
    assert set(choices["fsdp"]["backends"].values()) == {"fsdp"}
    assert set(choices["megatron"]["backends"].values()) == {"megatron"}
    mixed = choices["fsdp,megatron"]
    assert mixed["iteration_seconds"] == out["best"]["iteration_seconds"]
    assert mixed["iteration_seconds"] <= min(choices[b]["iteration_seconds"] for b in ("fsdp", "megatron")) + 1e-9
    for c in choices.values():  # each best plan's ops sum to its busiest lane at least
        assert "actor_update" in c["ops"] and 0 < max(c["ops"].values()) <= c["iteration_seconds"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "best plan per training engine" in text and "Δ megatron" in text


def test_request_that_cannot_fit_exits_2_with_breakdown_and_smallest_cluster(capsys):
    rc = main(["search", "--nodes", "1", "--model", "llama2-70b", "--algo", "ppo"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "optimizer" in err and "GiB" in err  # the memory breakdown
    assert "the smallest cluster that fits is" in err and "--nodes" in err
    nodes = int(err.split("--nodes ")[-1].split(")")[0])
    assert nodes > 1
    # and that cluster does fit
    assert main(["search", "--nodes", str(nodes), "--model", "llama2-70b", "--algo", "ppo", "--json", "--top", "1"]) == 0


@pytest.mark.parametrize("argv,msg", [
    (["--model", "gpt5"], "unknown model preset"),
    (["--model", "llama2-7b", "--cost", "llama2-7b"], "not a role of ppo"),
    ([], "give --model"),
    (["--model", "llama2-7b", "--out", "plan.txt"], "ending in .json"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, msg):
    assert main(["search", "--nodes", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_cluster_and_workload_files(tmp_path, capsys):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("hardware: h100-80g\nnodes: 2\ndevices_per_node: 4\n")
    wl = tmp_path / "wl.yaml"
    wl.write_text("prompts: 32\nprompt_len: 128\nresponse_len: 128\nsamples_per_prompt: 2\n")
    out = _json(capsys, ["search", "--cluster", str(cluster), "--workload", str(wl), "--response-len", "256",
                         "--algo", "rloo", "--model", "llama2-7b", "--json", "--top", "2"])
    best = out["best"]
    assert sum(best["devices"][g[0]] for g in best["placement"]) == 8
    # tokens per iteration = 32 prompts × 2 samples × (128 + 256): the flag overrides the file
    assert best["tokens_per_second"] * best["iteration_seconds"] == pytest.approx(32 * 2 * 384)


def test_max_pp_one_gives_pipeline_free_plans(capsys):
    out = _json(capsys, ["search", *SMALL, "--algo", "ppo", "--max-pp", "1", "--json", "--top", "3"])
    for s in out["top"]:
        for p in s["parallel"].values():
            assert all(cfg["pp"] == 1 for cfg in p.values())


def test_every_registered_algorithm_is_a_choice_and_roles_come_from_the_registry(capsys, tmp_path):
    from hybridflow.simulator.algorithms import get_algorithm

    out = _json(capsys, ["search", *SMALL, "--algo", "dapo", "--reward-function", "m:f",
                         "--json", "--top", "1", "--out", str(tmp_path / "dapo.json")])
    _check_summary(out["best"], ["actor", "ref"])
    assert Plan.load(tmp_path / "dapo.json").algorithm == "dapo"
    out = _json(capsys, ["search", *SMALL, "--algo", "safe-rlhf", "--cost-critic", "llama2-7b", "--json", "--top", "1"])
    _check_summary(out["best"], list(get_algorithm("safe-rlhf").roles))
    assert main(["search", *SMALL, "--algo", "ppo", "--cost-critic", "llama2-7b"]) == 2
    assert "--cost-critic is not a role of ppo" in capsys.readouterr().err


def test_modes_side_by_side_pick_the_fastest_within_the_staleness_limit(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    argv = ["search", *SMALL, "--nodes", "2", "--algo", "grpo", "--samples", "4", "--modes", "sync,one-step-off,async",
            "--json"]
    out = _json(capsys, [*argv, "--max-staleness", "2", "--out", str(plan_path)])
    assert set(out) == {"mode", "max_staleness", "modes", "best", "top", "search_seconds", "plans_priced"}
    assert list(out["modes"]) == ["sync", "one-step-off", "async"]
    assert [m["staleness"] for m in out["modes"].values()] == [0, 1, 2]
    for name, m in out["modes"].items():
        assert m["within_max_staleness"] and m["mode"] == name
        assert m["rollout_devices"] + m["training_devices"] == 16
        assert name == "sync" or m["rollout_devices"] > 0  # overlapping needs rollout devices apart
    fastest = min(out["modes"].values(), key=lambda m: (m["iteration_seconds"], m["staleness"]))
    # async's k = 2 halves the weight sync across the network, but it makes each batch's rollout in two calls of
    # half the batch, one after another (pricing/rollout_calls.py): at this batch that costs more than it saves
    assert out["mode"] == fastest["mode"] == "one-step-off"
    assert out["modes"]["async"]["iteration_seconds"] > fastest["iteration_seconds"]
    assert {**out["best"], "within_max_staleness": True} == fastest
    plan = Plan.load(plan_path)
    assert plan.mode == out["mode"] and plan.staleness == out["best"]["staleness"]
    assert simulate(plan).iteration_seconds() == pytest.approx(out["best"]["iteration_seconds"], rel=1e-9)
    # the default limit 0 keeps the plan synchronous, the other modes still shown beside it
    sync_only = _json(capsys, argv)
    assert sync_only["mode"] == "sync" and sync_only["max_staleness"] == 0
    assert not sync_only["modes"]["async"]["within_max_staleness"]
    assert sync_only["modes"]["sync"] == out["modes"]["sync"]
    assert main([*argv[:-1], "--max-staleness", "1"]) == 0
    text = capsys.readouterr().out
    assert "best plan per mode" in text and "one-step-off" in text and "rollout | training" in text


@pytest.mark.parametrize("argv,msg", [
    (["--modes", "sync,fast"], "unknown mode 'fast'"),
    (["--modes", "async"], "within --max-staleness 0"),
    (["--modes", "sync", "--max-staleness", "-1"], "--max-staleness must be 0 or more"),
    (["--gpus-per-node", "1", "--modes", "one-step-off,async", "--max-staleness", "2"],
     "no one-step-off or async plan fits on 1 device(s)"),
])
def test_bad_modes_are_one_line_and_exit_2(capsys, argv, msg):
    assert main(["search", "--nodes", "1", "--model", "llama2-7b", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_an_async_plan_under_a_long_tail_names_its_fastest_partial_rollout_budget(capsys):
    argv = ["search", "--gpu", "a100-80g", "--nodes", "2", "--gpus-per-node", "8", "--model", "llama2-7b", "--batch",
            "64", "--prompt-len", "256", "--response-lengths", "mean=256,max=2048", "--algo", "grpo", "--samples", "4",
            "--modes", "async", "--max-staleness", "4"]
    out = _json(capsys, [*argv, "--json"])
    partial = out["partial_rollouts"]
    assert list(partial["iteration_seconds"]) == ["without", "1024", "683", "512"]  # the longest over 2 … 4 rounds
    prices = partial["iteration_seconds"]
    picked = list(prices).index(str(partial["budget"] or "without"))
    least = min(prices.values())
    assert list(prices.values())[picked] == pytest.approx(least, rel=1e-9)  # the fastest, the first priced of equals
    assert all(t > least * (1 + 1e-9) for t in list(prices.values())[:picked])
    assert prices["without"] == pytest.approx(out["best"]["iteration_seconds"], rel=1e-9)  # the plan as searched
    assert main(argv) == 0
    assert "partial rollouts: " in capsys.readouterr().out
    out = _json(capsys, ["search", *SMALL, "--nodes", "2", "--algo", "grpo", "--samples", "4", "--modes", "async",
                         "--max-staleness", "2", "--json"])
    assert "partial_rollouts" not in out  # fixed lengths: no tail to cut
