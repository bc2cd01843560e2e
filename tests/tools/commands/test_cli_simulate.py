import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridflow.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]
PLANS = ROOT / "examples" / "plans"
COLOCATED = PLANS / "ppo-llama2-7b-1x8-colocated.json"
SPLIT = PLANS / "ppo-llama2-13b-2x8-split.json"


def run_json(capsys, *argv):
    assert main(["simulate", *map(str, argv), "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object on stdout


@pytest.mark.parametrize("plan", sorted(PLANS.glob("*.json")), ids=lambda p: p.stem)
def test_every_example_plan_simulates(capsys, plan):
    r = run_json(capsys, plan)
    assert r["iteration_seconds"] > 0
    doc = json.loads(plan.read_text())
    w = doc["workload"]
    tokens = w["prompts"] * w.get("samples_per_prompt", 1) * (w["prompt_len"] + w["response_len"])
    assert r["tokens_per_second"] == pytest.approx(tokens / r["iteration_seconds"])  # the paper's metric
    assert set(r["memory"]) == set(doc["roles"])
    for m in r["memory"].values():
        assert m["bytes_per_device"] > 0 and isinstance(m["fits"], bool)
    for op in r["ops"]:
        assert {"op", "model", "start", "end"} <= set(op) and op["end"] >= op["start"] >= 0
    assert r["iteration_seconds"] == pytest.approx(max(o["end"] for o in r["ops"]) - min(o["start"] for o in r["ops"]))


def test_ops_of_one_group_never_overlap_and_split_groups_do(capsys):
    r = run_json(capsys, SPLIT)
    by_group = {}
    for o in r["ops"]:
        for g in o["group"].split("+"):
            by_group.setdefault(g, []).append((o["start"], o["end"]))
    for spans in by_group.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    ops = {o["op"]: o for o in r["ops"]}
    # the critic's values run on node 1 while the actor computes log-probs on node 0
    assert ops["values"]["start"] < ops["actor_logprob"]["end"] and ops["actor_logprob"]["start"] < ops["values"]["end"]
    assert ops["advantage"]["start"] >= max(ops[k]["end"] for k in ("actor_logprob", "ref_logprob", "values", "reward"))


def test_colocated_iteration_is_the_sum_of_its_ops(capsys):
    r = run_json(capsys, COLOCATED)
    device_ops = [o for o in r["ops"] if o["group"] != "driver"]
    assert r["iteration_seconds"] == pytest.approx(sum(o["end"] - o["start"] for o in device_ops)
                                                    + sum(o["end"] - o["start"] for o in r["ops"]
                                                          if o["op"] == "advantage"))


def test_iterations_flag(capsys):
    one = run_json(capsys, COLOCATED)
    three = run_json(capsys, COLOCATED, "--iterations", "3")
    assert three["iterations"] == 3 and len(three["ops"]) == 3 * len(one["ops"])
    assert three["iteration_seconds"] == pytest.approx(one["iteration_seconds"])


def test_tables_trace_and_timeline(tmp_path, capsys):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", str(SPLIT), "--trace", str(trace), "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    for word in ("generate", "critic_update", "memory per device", "tokens/s", "actor_ref", "fits"):
        assert word in out
    tr = json.loads(trace.read_text())
    assert any(e.get("name") == "generate" and e["ph"] == "X" for e in tr["traceEvents"])
    assert png.read_bytes()[:4] == b"\x89PNG"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def plan_doc(**changes):
    doc = json.loads(COLOCATED.read_text())
    doc.update(changes)
    return doc


BAD = {
    "missing": lambda t: t / "nope.json",
    "malformed_json": lambda t: write(t, "bad.json", '{"algorithm": "ppo",'),
    "malformed_yaml": lambda t: write(t, "bad.yaml", "algorithm: [ppo\n  groups: {"),
    "unknown_hardware": lambda t: write(t, "hw.json", json.dumps(plan_doc(
        cluster={"hardware": "tpu-v9", "nodes": 1, "devices_per_node": 8}))),
    "unknown_model": lambda t: write(t, "m.json", json.dumps(plan_doc(roles={
        **plan_doc()["roles"], "critic": {"model": "gpt-5", "group": "all", "train": {"dp": 8}}}))),
    "tp_does_not_divide": lambda t: write(t, "tp.json", json.dumps(plan_doc(roles={
        **plan_doc()["roles"], "critic": {"model": "qwen2.5-7b", "group": "all", "train": {"tp": 8}}}))),
    "wrong_world_size": lambda t: write(t, "ws.json", json.dumps(plan_doc(roles={
        **plan_doc()["roles"], "ref": {"model": "llama2-7b", "group": "all", "train": {"dp": 4}}}))),
}
MESSAGE = {
    "missing": "no such file", "malformed_json": "not valid JSON", "malformed_yaml": "not valid YAML",
    "unknown_hardware": "known presets: a100-40g, a100-80g", "unknown_model": "known presets: llama2-7b",
    "tp_does_not_divide": "tp=8 must divide heads=28", "wrong_world_size": "uses 4 devices",
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, capsys, case):
    plan = BAD[case](tmp_path)
    png, trace = tmp_path / "out.png", tmp_path / "out.json"
    assert main(["simulate", str(plan), "--timeline", str(png), "--trace", str(trace)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and MESSAGE[case] in captured.err, captured.err
    assert not png.exists() and not trace.exists()


def test_bad_output_name_fails_before_anything_is_written(tmp_path, capsys):
    assert main(["simulate", str(COLOCATED), "--timeline", str(tmp_path / "t.svg")]) == 2
    assert "ending in .png" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_console_script_end_to_end(tmp_path):
    exe = shutil.which("hflow-plan") or pytest.skip("the hflow-plan console script is not installed")
    ok = subprocess.run([exe, "simulate", str(PLANS / "tiny-local.json"), "--json"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["tokens_per_second"] > 0
    bad = subprocess.run([exe, "simulate", str(tmp_path / "missing.json"), "--timeline", str(tmp_path / "x.png")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def long_tail_async_plan(tmp_path, staleness: int = 4) -> Path:
    """The partial-rollouts bench's async plan (tiny model, 2 devices) with its long tail: mean 64, longest 512."""
    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution
    from hybridflow.tools.bench.partial_rollouts import SHORTEST, bench_plan

    cal = calibrate_file("cpu-2core")
    plan = bench_plan(cal.cluster(nodes=1, devices_per_node=2), 512, 4, 4, staleness, reference=False)
    plan = plan.model_copy(update={"workload": plan.workload.model_copy(
        update={"response_lengths": LengthDistribution.max_entropy(64, 512, shortest=SHORTEST)})})
    return write(tmp_path, "async.json", plan.model_dump_json())


def test_partial_rollouts_priced_at_a_budget_and_the_fastest_picked(tmp_path, capsys):
    plan = long_tail_async_plan(tmp_path)
    auto = run_json(capsys, plan, "--profile", "cpu-2core", "--partial-rollout-tokens", "auto")
    prices = auto["partial_rollouts"]["iteration_seconds"]
    assert list(prices) == ["without", "256", "171", "128"]  # the longest over 2, 3 and 4 = k rounds
    least = min(prices.values())
    best = next(b for b, t in prices.items() if t <= least * (1 + 1e-9))  # the first priced of equals
    assert best != "without" and str(auto["partial_rollouts"]["budget"]) == best
    assert auto["iteration_seconds"] == pytest.approx(prices[best])  # the timeline shown is the pick's
    for budget, seconds in prices.items():  # each price is that budget's own simulation
        argv = [] if budget == "without" else ["--partial-rollout-tokens", budget]
        assert run_json(capsys, plan, "--profile", "cpu-2core", *argv)["iteration_seconds"] == pytest.approx(seconds)
    assert main(["simulate", str(plan), "--profile", "cpu-2core", "--partial-rollout-tokens", "auto"]) == 0
    assert f"partial rollouts: {best} new tokens per response per round, the fastest" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--partial-rollout-tokens", "512"], "--partial-rollout-tokens 512 is not below the response length 512"),
    (["--partial-rollout-tokens", "64"], "takes 8 rounds of --partial-rollout-tokens 64"),
    (["--partial-rollout-tokens", "lots"], "expected a positive whole number of tokens or auto, got 'lots'"),
])
def test_bad_partial_rollout_budget_is_one_line_exit_2(tmp_path, capsys, argv, says):
    assert main(["simulate", str(long_tail_async_plan(tmp_path)), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert main(["simulate", str(COLOCATED), "--partial-rollout-tokens", "auto"]) == 2  # a sync plan
    assert "the plan's mode is 'sync': use --mode async" in capsys.readouterr().err
