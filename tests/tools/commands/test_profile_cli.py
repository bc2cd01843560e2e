"""`hflow-plan profile --quick` measures the real engines into a valid profile; `replay` prices plans
from a profile without torch, and compares with a run's metrics file op by op."""

import contextlib
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.simulator import Plan
from hybridflow.simulator.calibration.profile import Fingerprint, Profile, ProfilePoint
from hybridflow.simulator.vocabulary.hardware import HardwareSpec
from hybridflow.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY_PLAN = ROOT / "examples" / "plans" / "tiny-local.json"
HW = HardwareSpec(name="cpu-t", peak_flops=5e9, hbm_bandwidth=1e9, hbm_bytes=8e9, intra_node_bandwidth=2e8,
                  inter_node_bandwidth=2e8, intra_node_latency=5e-4)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    """One real `hflow-plan profile --quick --passes 2` run (gloo processes), shared by the tests below. The
    command's main() in this process: its gloo ranks fork from the session's warm forkserver, rather than a
    fresh interpreter importing torch and starting a forkserver of its own (exit codes of the installed
    command: test_cli_simulate.py)."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("prof") / "quick.json"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["profile", "--quick", "--passes", "2", "--out", str(out)])
    assert rc == 0, stderr.getvalue()[-2000:]
    return out, stdout.getvalue()


@pytest.mark.slow
def test_quick_profile_measures_every_op_kind(quick_profile):
    path, stdout = quick_profile
    p = Profile.load(path)
    ops = p.by_op()
    assert set(ops) == {"matmul", "memory", "forward", "train", "generate", "reshard", "allreduce", "allgather"}
    assert all(pt.seconds > 0 for pt in p.points)
    # two passes over the grid, merged: every job's point counts both passes' timed runs (1 each)
    assert all(pt.repeats >= 2 for pt in p.points if pt.op in ("forward", "train", "generate", "reshard"))
    assert "passes 2" in p.notes
    assert p.fingerprint.device_kind == "cpu" and p.fingerprint.devices == 2 and p.fingerprint.dtype == "float32"
    assert {pt.parallel.tp for pt in ops["generate"]} == {1, 2}
    # decoding more tokens takes longer than the prefill alone, at the same layout and batch
    by_len = {(pt.parallel.tp, pt.response_len): pt.seconds for pt in ops["generate"]}
    assert by_len[(1, 4)] > by_len[(1, 1)]
    # the reshard moved what Table 2 says: (t - t_g)/(t_g t) of the tp-sharded weights, per device
    assert ops["reshard"][0].bytes > 0
    assert p.hardware.peak_flops > 1e8 and p.hardware.intra_node_latency > 0
    assert "median |err|" in stdout and "generate" in stdout  # the fit's error per op kind


@pytest.mark.slow
def test_replay_of_a_measured_profile(quick_profile, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path))
    path, _ = quick_profile
    assert main(["replay", str(path), "--plan", str(TINY_PLAN), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["plans"][0]["iteration_seconds"] > 0
    assert set(r["errors"]) >= {"forward", "train", "generate"}


def test_profile_rejects_bad_output_names(tmp_path, capsys):
    assert main(["profile", "--quick", "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ending in .json" in err[0]
    assert main(["profile", "--quick", "--out", str(tmp_path)]) == 2
    assert main(["profile", "--quick", "--passes", "0", "--out", str(tmp_path / "p.json")]) == 2
    assert "--passes" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_passes_merge_by_median_and_pool_their_spread():
    pytest.importorskip("torch")
    from hybridflow.runtime.measure.profiling import merge_passes

    job = {"op": "train", "batch": 8}
    passes = [[{**job, "seconds": s, "std": 0.01, "repeats": 3}] for s in (0.10, 0.13, 0.11)]
    (row,) = merge_passes(passes)
    assert row["seconds"] == 0.11 and row["repeats"] == 9 and row["op"] == "train"
    between = ((0.10 - 0.1133) ** 2 + (0.13 - 0.1133) ** 2 + (0.11 - 0.1133) ** 2) / 3
    assert row["std"] == pytest.approx((0.01**2 + between) ** 0.5, rel=1e-2)
    assert merge_passes(passes[:1]) == passes[0]  # one pass: its rows as they are


# ---- replay on a hand-made profile (no torch) ------------------------------------------------------
def hand_profile(tmp_path) -> Path:
    tiny = "tiny"
    pts = []
    for b, s, t in ((8, 32, 0.03), (32, 64, 0.2), (16, 32, 0.06)):
        pts.append(ProfilePoint(op="forward", model=tiny, batch=b, micro_batch=8, prompt_len=s // 2,
                                response_len=s // 2, seconds=t, repeats=3))
        pts.append(ProfilePoint(op="train", model=tiny, batch=b, micro_batch=8, prompt_len=s // 2,
                                response_len=s // 2, seconds=3.2 * t, repeats=3))
    for b, r, t in ((4, 1, 0.004), (4, 16, 0.05), (32, 16, 0.09)):
        pts.append(ProfilePoint(op="generate", model=tiny, batch=b, prompt_len=16, response_len=r, seconds=t))
    for size, t in ((2**16, 0.001), (2**20, 0.008), (2**24, 0.12)):
        pts.append(ProfilePoint(op="allreduce", size_bytes=size, group_size=2, seconds=t))
    prof = Profile(name="hand", fingerprint=Fingerprint(devices=2), hardware=HW, points=pts)
    return prof.save(tmp_path / "hand.json")


def metrics_file(tmp_path, rows) -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_replay_compares_predicted_with_measured_per_op(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "cache"))
    prof = hand_profile(tmp_path)
    assert main(["replay", str(prof), "--plan", str(TINY_PLAN), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)["plans"][0]
    ops = priced["op_seconds"]
    # a run whose ops took exactly twice the prediction (iteration 1 is start-up: skipped)
    rows = [{"iteration": 1, "seconds": 99.0, "op_seconds": {op: 50.0 for op in ops}},
            *({"iteration": i, "seconds": 2 * priced["iteration_seconds"],
               "op_seconds": {op: 2 * s for op, s in ops.items()}} for i in (2, 3))]
    assert main(["replay", str(prof), "--plan", str(TINY_PLAN), "--metrics", str(metrics_file(tmp_path, rows)),
                 "--json"]) == 0
    cmp = json.loads(capsys.readouterr().out)["comparison"]
    assert cmp["iterations"] == 2
    assert cmp["iteration"]["error"] == pytest.approx(-0.5)
    for op, r in cmp["ops"].items():
        if r["measured"] > 0:
            assert r["error"] == pytest.approx(-0.5), op
    # the table form runs too, and lists the profile's points
    assert main(["replay", str(prof), "--plan", str(TINY_PLAN), "--metrics", str(tmp_path / "metrics.jsonl"),
                 "--points"]) == 0
    out = capsys.readouterr().out
    assert "predicted vs measured" in out and "profile points" in out


@pytest.mark.parametrize("args, msg", [
    (["--metrics", "m.jsonl"], "exactly one --plan"),
    (["--plan", str(TINY_PLAN), "--metrics", "missing.jsonl"], "no such file"),
    (["--plan", str(TINY_PLAN), "--metrics", "bad.jsonl"], "line 1 is not JSON"),
    (["--plan", str(TINY_PLAN), "--metrics", "short.jsonl"], "none left after skipping 1"),
])
def test_replay_bad_input_is_one_line(tmp_path, capsys, monkeypatch, args, msg):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    prof = hand_profile(tmp_path)
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    metrics_file(tmp_path, [{"seconds": 1.0, "op_seconds": {}}]).rename(tmp_path / "short.jsonl")
    assert main(["replay", str(prof), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err


def test_replay_needs_no_torch(tmp_path):
    prof = hand_profile(tmp_path)
    code = ("import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
            "from hybridflow.tools.cli import main\n"
            f"sys.exit(main(['replay', {str(prof)!r}, '--plan', {str(TINY_PLAN)!r}, '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"HFLOW_CACHE": str(tmp_path / "c"), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["plans"][0]["iteration_seconds"] > 0
    assert "torch" not in proc.stderr


def test_plan_loads(tmp_path):
    assert Plan.load(TINY_PLAN).roles["actor"].model.name == "tiny"


def test_profile_option_helpers_move_plans_and_requests(tmp_path, monkeypatch):
    from hybridflow.planner.request import SearchRequest
    from hybridflow.planner.search import search
    from hybridflow.simulator import ClusterSpec, Workload, model_preset
    from hybridflow.simulator.calibration.profiled_cost import ProfiledCostModel
    from hybridflow.simulator.schedule.schedule import simulate
    from hybridflow.tools.profile_option import plan_with_profile, request_with_profile

    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "cache"))
    prof = str(hand_profile(tmp_path))
    plan = Plan.load(TINY_PLAN)
    assert plan_with_profile(plan, None) == (plan, None)
    moved, cm = plan_with_profile(plan, prof)
    assert isinstance(cm, ProfiledCostModel) and moved.cluster.hardware.name == "cpu-t"
    assert moved.cluster.devices_per_node == plan.cluster.devices_per_node
    assert simulate(moved, cm).iteration_seconds(0) > 0
    req = SearchRequest.for_algorithm("ppo", model_preset("tiny"), ClusterSpec(hardware="a100-80g", nodes=1,
                                      devices_per_node=2), Workload(prompts=16, prompt_len=16, response_len=8), max_pp=1)
    req2, cm2 = request_with_profile(req, prof)
    assert req2.cluster.hardware.name == "cpu-t" and req2.cluster.devices_per_node == 2
    best = search(req2, cm2).top[0]
    assert best.seconds > 0


def test_probe_figures_follow_from_the_raw_timings():
    pytest.importorskip("torch")
    from hybridflow.runtime.measure.hardware_probe import COPY_BYTES, LARGE, probe_points, spec_from_probe

    raw = {"matmul_n": 512, "matmul_s": 0.05, "copy_s": 0.02, "allreduce_small_s": 0.001,
           "allreduce_large_s": 0.009, "elem_bytes": 4}
    hw = spec_from_probe(raw, world=2)
    assert hw.peak_flops == pytest.approx(2 * 512**3 / 0.05)
    # bandwidths per bf16-equivalent byte: half the fp32 figure
    assert hw.hbm_bandwidth == pytest.approx(2 * COPY_BYTES / 0.02 / 2)
    assert hw.intra_node_bandwidth == pytest.approx(LARGE / 0.008 / 2)  # ring: 2(n-1)/n = 1 for n = 2
    assert hw.intra_node_latency == 0.001
    pts = probe_points(raw, 2)
    assert [p.op for p in pts] == ["matmul", "memory"] and pts[0].flops == 2 * 512**3


def test_megatron_roles_on_a_profile_without_megatron_points_say_so(capsys):
    from hybridflow.simulator.calibration.fit import Calibration
    from hybridflow.simulator.calibration.profiled_cost import EngineOverheads
    from hybridflow.simulator.pricing.efficiency import EfficiencyParams
    from hybridflow.tools.profile_option import plan_with_profile

    plan = Plan.load(TINY_PLAN)
    roles = {r: rp.model_copy(update={"train": rp.train.model_copy(update={"backend": "megatron"})})
             if r == "actor" else rp for r, rp in plan.roles.items()}
    megatron_plan = plan.model_copy(update={"roles": roles})
    without = Calibration(profile="fsdp-only", hardware=HW, params=EfficiencyParams(),
                          overheads=EngineOverheads(layer_seconds=1e-3))  # as fitted to FSDP points alone
    _, cm = plan_with_profile(megatron_plan, without)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no megatron_train / megatron_forward points" in err[0] and "--add-megatron" in err[0]
    assert cm.overheads.megatron_layer_seconds == 0.0  # the analytic price for the megatron actor
    plan_with_profile(plan, without)  # FSDP roles only: nothing to say
    with_points = without.model_copy(update={"overheads": EngineOverheads(megatron_layer_seconds=1e-3)})
    plan_with_profile(megatron_plan, with_points)  # priced by its own terms: nothing to say
    assert capsys.readouterr().err == ""


def test_megatron_points_need_megatron_and_a_profile_of_this_machine(tmp_path, capsys, monkeypatch):
    import importlib.util

    assert main(["profile", "--add-megatron", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    foreign = Profile(name="f", fingerprint=Fingerprint(device_name="gpu-9000", cpu_count=999, devices=2),
                      hardware=HW).save(tmp_path / "foreign.json")
    before = foreign.read_text()
    assert main(["profile", "--add-megatron", str(foreign)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    why = "not this machine" if importlib.util.find_spec("megatron") else "pip install 'hybridflow[megatron]'"
    assert len(err) == 1 and why in err[0], err
    assert foreign.read_text() == before
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("megatron")
                        else real_find_spec(name, *a))
    assert main(["profile", "--quick", "--megatron", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hybridflow[megatron]" in err[0] and not (tmp_path / "p.json").exists()


def test_the_megatron_grid_spans_dp_tp_pp_at_the_fsdp_shapes_and_fits_each_model():
    from hybridflow.tools.commands.profile import grid, megatron_grid

    jobs = megatron_grid(2)
    points = [ProfilePoint(seconds=1.0, **j) for j in jobs]  # valid points once timed
    assert {p.op for p in points} == {"megatron_train", "megatron_forward"}
    assert {(p.parallel.pp, p.parallel.tp, p.parallel.dp) for p in points} == {(1, 1, 2), (1, 2, 1), (2, 1, 1)}
    fsdp_shapes = {(j["batch"], j["prompt_len"], j["response_len"]) for j in grid(2) if j["op"] == "train"}
    assert {(p.batch, p.prompt_len, p.response_len) for p in points} == fsdp_shapes
    layouts = [p.parallel for p in points]
    runs = [x for i, x in enumerate(layouts) if i == 0 or layouts[i - 1] != x]
    assert len(runs) == len(set(runs)) == 3  # one layout's jobs together: its engines are built once
    assert all(p.model.layers % p.parallel.pp == 0 for p in (ProfilePoint(seconds=1.0, **j) for j in megatron_grid(4)))


def test_add_reward_times_the_builtin_rewards_into_a_profile_of_this_machine(tmp_path, capsys):
    """`--add-reward`: one point per built-in task, replacing the profile's earlier ones; the fit then prices
    the reward op at their median seconds per sequence. The probe runs for real (milliseconds, no Ray)."""
    from hybridflow.runtime.measure.hardware_probe import fingerprint
    from hybridflow.runtime.tasks.builtin import TASKS
    from hybridflow.simulator.calibration.fit import calibrate

    path = hand_profile(tmp_path)
    here = Profile.load(path)
    old = ProfilePoint(op="reward", mode="sort", batch=128, response_len=8, seconds=9.0)
    here = here.model_copy(update={"fingerprint": fingerprint(2), "points": [*here.points, old], "notes": "grid"})
    here.save(path)
    assert main(["profile", "--add-reward", str(path)]) == 0
    assert "reward points added" in capsys.readouterr().out
    p = Profile.load(path)
    rewards = p.by_op()["reward"]
    assert sorted(r.mode for r in rewards) == sorted(TASKS) and all(0 < r.seconds < 9.0 for r in rewards)
    assert len(p.points) == len(here.points) - 1 + len(TASKS) and p.notes.startswith("grid; reward points:")
    per_sequence = statistics.median(r.seconds / r.batch for r in rewards)
    assert calibrate(p).params.rule_reward_seconds_per_sequence == pytest.approx(per_sequence)


def test_add_alone_times_reference_points_alone_and_all_busy_into_a_profile_of_this_machine(tmp_path, capsys):
    """`--add-alone`: per quick reference point one point on 1 device and one on both (replacing the
    earlier ones); the fit's alone_speedup is their median busy / alone ratio, at least 1. The probe runs
    for real (two process groups of the tiny model's quick points)."""
    from hybridflow.runtime.measure.hardware_probe import fingerprint
    from hybridflow.simulator.calibration.fit import calibrate
    from hybridflow.simulator.calibration.measured_terms import alone_speedup

    path = hand_profile(tmp_path)
    here = Profile.load(path)
    old = ProfilePoint(op="alone", mode="train", model="tiny", batch=8, prompt_len=16, response_len=16, seconds=9.0)
    here = here.model_copy(update={"fingerprint": fingerprint(2), "points": [*here.points, old], "notes": "grid"})
    here.save(path)
    assert main(["profile", "--add-alone", str(path), "--passes", "1"]) == 0
    assert "alone points added" in capsys.readouterr().out
    p = Profile.load(path)
    alone = p.by_op()["alone"]
    assert sorted(a.group_size for a in alone) == [1] * (len(alone) // 2) + [2] * (len(alone) // 2)
    assert len(alone) >= 4
    assert all(a.seconds < 9.0 for a in alone) and p.notes.startswith("grid; alone points:")
    assert calibrate(p).overheads.alone_speedup == alone_speedup(p) >= 1.0
