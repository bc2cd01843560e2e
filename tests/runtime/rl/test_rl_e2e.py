"""End to end on a local Ray cluster with the tiny model: PPO, RLOO, ReMax and Safe-RLHF for three iterations
in several placements (test_algorithms_e2e.py runs the other algorithms), each run's calls equal to the
simulator's graph of its plan; the measured timeline (disjoint groups overlap), GRPO through the CLI,
checkpoint/resume bit-identical to a straight run, and a dead worker one clear error that loses nothing."""

import json
import math

import pytest
from rl_util import simulated_calls, tiny_plan

from hybridflow.runtime.rl.run_events import RunEvents
from hybridflow.simulator import OPS, ParallelConfig, Workload

pytestmark = [pytest.mark.ray, pytest.mark.slow]

COMMON_OPS = {"reshard", "generate", "reward", "actor_logprob", "ref_logprob", "advantage", "actor_update"}
ITERATIONS = 3  # every check is per iteration; more only add seconds


def _run(plan, tmp_path, iterations=ITERATIONS, **kw):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    metrics_path = tmp_path / "metrics.jsonl"
    with Trainer(plan, RunConfig(**kw), metrics_path=metrics_path) as t:
        out = t.run(iterations)
        timeline = t.timeline
        assert t.df.calls == simulated_calls(plan, t.config.kl_in_reward)  # what ran is what the simulator prices
    lines = [json.loads(x) for x in metrics_path.read_text().splitlines()]
    assert lines == json.loads(json.dumps(out))  # one JSON line per iteration, as returned
    return out, timeline


def _check_common(out, timeline, ops):
    its = list(range(1, ITERATIONS + 1))
    assert [m["iteration"] for m in out] == its
    for m in out:
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["actor/step"] == m["iteration"]
        assert math.isfinite(m["actor/pg_loss"]) and m["tokens_per_second"] > 0
        assert set(m["op_seconds"]) == ops, set(m["op_seconds"]) ^ ops
    assert timeline.source == "measured" and {e.op for e in timeline.events} <= set(OPS)
    assert timeline.iterations() == its


def test_ppo_and_disjoint_groups_overlap(ray_local, tmp_path):
    plan = tiny_plan("ppo", [["actor", "ref"], ["critic"]])
    out, timeline = _run(plan, tmp_path)
    _check_common(out, timeline, COMMON_OPS | {"values", "critic_update"})
    assert all(math.isfinite(m["critic/loss"]) and m["critic/step"] == m["iteration"] for m in out)
    for it in range(1, ITERATIONS + 1):
        evs = {(e.op, e.group): e for e in timeline.events if e.iteration == it}
        actor, critic = evs[("actor_update", "g0")], evs[("critic_update", "g1")]
        overlap = min(actor.end, critic.end) - max(actor.start, critic.start)
        assert overlap > 0, f"critic and actor updates on disjoint groups did not overlap in iteration {it}"
        # and ops of one group never overlap each other (one process per device runs one op at a time)
        g0 = sorted((e for e in timeline.events if e.iteration == it and e.group == "g0"), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-6 for a, b in zip(g0, g0[1:], strict=False))


def test_cli_run_grpo_data_parallel_writes_metrics_trace_and_timeline(ray_local, tmp_path, capsys):
    from hybridflow.tools.cli import main

    w = Workload(prompts=2, samples_per_prompt=4, prompt_len=16, response_len=8, micro_batch_size=4)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]], [2], workload=w).model_dump_json())
    files = {k: tmp_path / f for k, f in (("metrics", "m.jsonl"), ("trace", "t.json"), ("timeline", "t.png"))}
    rc = main(["run", str(plan_file), "--iterations", "2", "--json", "--metrics", str(files["metrics"]),
               "--trace", str(files["trace"]), "--timeline", str(files["timeline"])])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["iteration"] for m in out["iterations"]] == [1, 2]
    assert all(m["tokens"] > 8 * 8 and 0 <= m["reward_mean"] <= 1 for m in out["iterations"])  # 8 sequences
    assert {"generate", "actor_update", "ref_logprob"} <= set(out["measured"]["op_seconds"])
    assert out["predicted"]["iteration_seconds"] > 0
    assert len(files["metrics"].read_text().splitlines()) == 2
    assert json.loads(files["trace"].read_text())["traceEvents"]
    assert files["timeline"].read_bytes()[:4] == b"\x89PNG"
    # the response lengths it recorded are what `search --response-lengths METRICS.jsonl` plans for
    recorded = [json.loads(x)["response_lengths"] for x in files["metrics"].read_text().splitlines()]
    assert all(1 <= r["min"] <= r["p50"] <= r["max"] <= 8 for r in recorded)
    assert main(["search", "--model", "llama2-7b", "--algo", "grpo", "--samples", "4", "--prompt-len", "16",
                 "--response-lengths", str(files["metrics"]), "--json", "--top", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["iteration_seconds"] > 0


def test_rloo_separate_reference_group(ray_local, tmp_path):
    w = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8, mini_batches=1)
    out, timeline = _run(tiny_plan("rloo", [["actor"], ["ref"]], workload=w), tmp_path,
                         kl={"placement": "loss", "estimator": "k3"})
    # one epoch of one mini-batch, KL in the loss: the update's own log-probs are the old ones
    _check_common(out, timeline, COMMON_OPS - {"actor_logprob"})
    assert all("actor/kl_loss" in m and math.isfinite(m["kl"]) for m in out)


def test_remax_tensor_parallel_training_resharded_for_generation(ray_local, tmp_path):
    # Training tp=2 → generation tp=1 (two replicas): the 3D-HybridEngine all-gathers inside micro-DP groups.
    plan = tiny_plan("remax", [["actor", "ref"]], [2], train={"actor": ParallelConfig(tp=2), "ref": ParallelConfig(dp=2)},
                     generate=ParallelConfig(tp=1, dp=2))
    out, timeline = _run(plan, tmp_path)
    _check_common(out, timeline, COMMON_OPS | {"generate_baseline"})
    reshard = [e for e in timeline.events if e.op == "reshard"]
    assert len(reshard) == ITERATIONS and all(e.bytes > 0 for e in reshard)  # once per iteration, bytes counted


def test_safe_rlhf_with_a_cost_model(ray_local, tmp_path):
    # The cost is a scalar-head model in HF format (ValueWorker.compute_scores), colocated with the rest.
    import torch

    from hybridflow.runtime.models.decoder import ScoreModel
    from hybridflow.runtime.models.hf_format import save_pretrained

    torch.manual_seed(0)
    cost_model = ScoreModel(tiny_plan().roles["actor"].model.decoder_config())
    save_pretrained(cost_model, tmp_path / "cost")
    plan = tiny_plan("safe-rlhf", [["actor", "ref", "critic", "cost_critic", "cost"]],
                     paths={"cost": str(tmp_path / "cost")})
    out, timeline = _run(plan, tmp_path, lagrange={"threshold": 0.0, "lr": 0.05})
    _check_common(out, timeline, COMMON_OPS | {"values", "critic_update", "cost"})
    assert {e.group for e in timeline.events if e.op == "cost"} == {"g0"}  # scored on the devices, not the driver
    assert {e.role for e in timeline.events if e.op == "critic_update"} == {"critic", "cost_critic"}
    assert all(math.isfinite(m["cost_critic/loss"]) for m in out)
    lam = 1.0
    for i, m in enumerate(out):  # λ first: exp(log λ + lr·(mean cost of the episodes so far − threshold)·λ)
        assert m["episode_cost"] == pytest.approx(sum(x["cost_mean"] for x in out[:i + 1]) / (i + 1), rel=1e-5)
        lam = math.exp(math.log(lam) + 0.05 * m["episode_cost"] * lam)
        assert m["lagrange"] == pytest.approx(lam, rel=1e-6)


class PhaseLog(RunEvents):
    """Keeps the phases a trainer reports."""

    def __init__(self):
        self.phases: list[tuple[str, str]] = []

    def phase(self, name, text, total=None):
        self.phases.append((name, text))


def test_resume_is_bit_identical_to_a_straight_run_and_a_dead_worker_loses_nothing(ray_local, tmp_path):
    # A straight run of 4 checkpoints after every iteration. Then a worker dies (the kernel's OOM killer):
    # as `hflow-plan run` reports it, one line naming role, rank and the likely cause, exit code 3, the
    # checkpoints and metrics as they were. A fresh trainer resumed from the checkpoint of iteration 2 (as if
    # the run had stopped there) must end exactly where the straight run ended. (One straight run serves both:
    # each trainer start costs seconds of worker start-up.)
    import os
    import signal

    from rich.console import Console

    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.simulator.errors import WorkerLostError
    from hybridflow.tools.reports.run import ConsoleEvents, run_with_progress

    plan = tiny_plan("ppo", [["actor", "ref", "critic"]])
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    with Trainer(plan, checkpoint_dir=ckpt, metrics_path=metrics) as t:
        straight = t.run(4)
        want = t.fingerprints()
        os.kill(t.groups["actor"].nodes[0]["pid"], signal.SIGKILL)  # as the kernel's OOM killer would (no record of it)
        with pytest.raises(WorkerLostError, match=r"worker 'actor' rank 0 of group 'g0'.*was killed by a signal") as e:
            run_with_progress(t, 1, False, ConsoleEvents(Console(file=open(os.devnull, "w")), quiet=True))  # noqa: SIM115
        assert e.value.exit_code == 3 and "\n" not in str(e.value)
    assert (ckpt / "latest").read_text().strip() == "iter_000004"
    assert len(metrics.read_text().splitlines()) == 4  # the failed iteration wrote nothing
    # the default keep_last (3): the oldest checkpoint went once the fourth was complete
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_000002", "iter_000003", "iter_000004"]
    (ckpt / "latest").write_text("iter_000002\n")
    events = PhaseLog()
    with Trainer(plan, checkpoint_dir=ckpt, events=events, metrics_path=metrics) as t:
        resumed = t.run(2, resume=True)
        got = t.fingerprints()
    # iterations 3 and 4 ran twice; the resumed run's lines replaced the first run's
    assert [json.loads(x) for x in metrics.read_text().splitlines()] == json.loads(json.dumps(straight[:2] + resumed))
    # every phase said what it did: the workers, each role's weights, which checkpoint it resumed from
    names = [name for name, _ in events.phases]
    assert names[names.index("workers"):] == ["workers", "weights", "weights", "weights", "resume"]
    assert "iter_000002" in events.phases[-1][1] and "after iteration 2" in events.phases[-1][1]
    assert got == want  # parameters, optimizer states and step of actor and critic, every rank
    for a, b in zip(straight[2:], resumed, strict=True):
        assert a["iteration"] == b["iteration"] and b["actor/step"] == a["actor/step"]
        assert (a["reward_mean"], a["actor/pg_loss"], a["critic/loss"]) == (b["reward_mean"], b["actor/pg_loss"],
                                                                           b["critic/loss"])


def test_checkpoints_at_a_url_resume_bit_exactly(ray_local, tmp_path, monkeypatch):
    # --checkpoint-dir and --export-hf as file:// URLs: every write goes through fsspec (the shards through
    # DCP's fsspec writer, from two ranks in two processes) and nothing takes the URL for a path (which
    # would make a folder "file:" in the working directory). One trainer serves both runs: 2 iterations
    # straight, then rewound to the checkpoint of iteration 1 and run on to 2 again, bit-exactly.
    from hybridflow.runtime.controller.locations import Location
    from hybridflow.runtime.rl.checkpoints import latest_name, publish_latest
    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.tools.cli import main

    monkeypatch.chdir(tmp_path)
    plan = tiny_plan("grpo", [["actor", "ref"]], devices=[2],
                     workload=Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8,
                                       micro_batch_size=4, mini_batches=1))
    ckpt, export = Location(f"file://{tmp_path}/ckpt"), Location(f"file://{tmp_path}/export")
    with Trainer(plan, checkpoint_dir=ckpt.url, export_dir=export.url) as t:
        straight = t.run(2)
        want = t.fingerprints()
        assert latest_name(ckpt) == "iter_000002"
        assert sorted(p.name for p in ckpt.children()) == ["iter_000001", "iter_000002", "latest", "run.lock"]
        assert {"config.json", "dcp", "extra_rank0.pt", "extra_rank1.pt"} <= {
            p.name for p in (ckpt / "iter_000001" / "actor").children()}
        assert (export / "iter_000002" / "actor" / "model.safetensors").is_file()
        publish_latest(ckpt, "iter_000001")
        resumed = t.run(1, resume=True)
        assert t.fingerprints() == want  # parameters, optimizer states and step, both ranks
    assert [m["reward_mean"] for m in resumed] == [m["reward_mean"] for m in straight[1:]]
    # `hflow-plan export` reads the URL checkpoint (DCP's fsspec reader) and writes to a URL: the run's export
    assert main(["export", ckpt.url, "--out", f"file://{tmp_path}/out"]) == 0
    assert (tmp_path / "out/actor/model.safetensors").read_bytes() == (
        tmp_path / "export/iter_000002/actor/model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export", "out"]  # no marker, no "file:" folder


def test_quickstart_json_shape(ray_local, capsys):
    from hybridflow.tools.cli import main

    assert main(["quickstart", "--iterations", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"plan", "iterations", "evaluations", "predicted", "comparison"}
    assert [e["iteration"] for e in out["evaluations"]] == [0, 2]  # held-out prompts before and after
    assert {"placement", "devices", "parallel", "iteration_seconds", "tokens_per_second"} <= set(out["plan"])
    assert [it["iteration"] for it in out["iterations"]] == [1, 2]
    for it in out["iterations"]:
        assert set(it) == {"iteration", "reward_mean", "tokens_per_second", "op_seconds"}
        assert 0 <= it["reward_mean"] <= 1 and it["tokens_per_second"] > 0 and "generate" in it["op_seconds"]
    assert out["predicted"]["iteration_seconds"] > 0 and "generate" in out["predicted"]["op_seconds"]
    # the comparison's throughput is the trainer's figure of the one measured iteration it uses (the second)
    assert out["comparison"]["throughput"]["measured"] == pytest.approx(out["iterations"][1]["tokens_per_second"])
