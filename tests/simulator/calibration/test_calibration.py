"""Calibration: the fit recovers known figures from synthetic points, reports its error per op kind,
and a calibrated cost model prices plans (simulate) and stays compatible with the planner."""

import math

import pytest

from hybridflow.simulator import ClusterSpec, HflowError, ModelSpec, ParallelConfig, Plan
from hybridflow.simulator.calibration.fit import (
    PINNED,
    Calibration,
    Term,
    calibrate,
    calibrate_file,
    cost_model_from_profile,
    plan_on_profile,
    predict_point,
)
from hybridflow.simulator.calibration.profile import Fingerprint, Profile, ProfilePoint
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import CPU_ATTENTION_KEY_BLOCK, EfficiencyParams
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.simulator.vocabulary.hardware import HardwareSpec
from hybridflow.simulator.vocabulary.workload import Workload

TRUE_HW = HardwareSpec(name="cpu-x", peak_flops=4e10, hbm_bandwidth=5e9, hbm_bytes=8e9, intra_node_bandwidth=1e9,
                       inter_node_bandwidth=1e9, intra_node_latency=2e-4)
# a CPU device's (the synthetic fingerprint's): its attention kernel's key blocks are not fitted but known
TRUE_PARAMS = EfficiencyParams().model_copy(update={**PINNED, "tokens_half": 64.0, "width_half": 32.0,
                                                    "decode_step_overhead": 2e-3, "adam_bytes_per_param": 6.0,
                                                    "attention_key_block": CPU_ATTENTION_KEY_BLOCK})
TRUE_OVERHEADS = EngineOverheads(layer_seconds=3e-4, backward_layer_seconds=8e-4, decode_layer_seconds=2e-4,
                                 tp_layer_seconds=4e-3, tp_backward_layer_seconds=1.2e-2, tp_decode_layer_seconds=9e-3,
                                 dp_layer_seconds=2e-3,
                                 reshard_layer_seconds=1e-3, dp_gather_layer_seconds=3e-3, call_seconds=2e-3,
                                 step_seconds=5e-3, backward_ratio=1.5)
# The probe's guess the fit starts from: every figure off by 2.5-10x.
START_HW = HardwareSpec(name="cpu-x", peak_flops=1e10, hbm_bandwidth=2e10, hbm_bytes=8e9, intra_node_bandwidth=3e8,
                        inter_node_bandwidth=3e8, intra_node_latency=1e-3)
MODELS = [ModelSpec(name=f"m{h}", layers=layers, hidden=h, heads=4, kv_heads=4, ffn=4 * h, vocab=64)
          for h, layers in ((64, 2), (128, 4), (256, 3))]
RECOVERED = ("hardware.peak_flops", "hardware.hbm_bandwidth", "hardware.intra_node_bandwidth",
             "hardware.intra_node_latency", "params.tokens_half", "params.width_half", "params.decode_step_overhead",
             "params.adam_bytes_per_param", "overheads.layer_seconds", "overheads.backward_layer_seconds",
             "overheads.decode_layer_seconds", "overheads.tp_layer_seconds", "overheads.tp_backward_layer_seconds",
             "overheads.tp_decode_layer_seconds", "overheads.dp_layer_seconds", "overheads.reshard_layer_seconds",
             "overheads.dp_gather_layer_seconds", "overheads.call_seconds", "overheads.step_seconds",
             "overheads.backward_ratio")


def synthetic_points(noise: float = 0.0, params: EfficiencyParams = TRUE_PARAMS) -> list[ProfilePoint]:
    """A profile-shaped grid priced by the TRUE model (times a deterministic ±noise pattern)."""
    cm = ProfiledCostModel(ClusterSpec(hardware=TRUE_HW, nodes=1, devices_per_node=2), params, TRUE_OVERHEADS)
    jobs = []
    for m in MODELS:
        for par in (ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(dp=2)):
            for b, s, mb, steps in ((8, 32, 8, 1), (32, 64, 16, 2)):
                jobs.append(dict(op="forward", model=m, parallel=par, batch=b, micro_batch=mb, prompt_len=s // 2,
                                 response_len=s // 2))
                jobs.append(dict(op="train", model=m, parallel=par, batch=b, micro_batch=mb, steps=steps,
                                 prompt_len=s // 2, response_len=s // 2))
            for b, r in ((4, 1), (4, 16), (32, 32)):
                jobs.append(dict(op="generate", model=m, parallel=par, batch=b, prompt_len=16, response_len=r))
        jobs.append(dict(op="reshard", model=m, parallel=ParallelConfig(tp=2), gen=ParallelConfig(dp=2),
                         mode="ds-chat"))
        jobs.append(dict(op="reshard", model=m, parallel=ParallelConfig(dp=2), gen=ParallelConfig(dp=2),
                         mode="hybridflow"))  # FSDP's dp gather only
    for size in (2**12, 2**16, 2**20, 2**24):
        jobs += [dict(op="allreduce", size_bytes=size, group_size=2), dict(op="allgather", size_bytes=size,
                                                                            group_size=2)]
    points = []
    for i, job in enumerate(jobs):
        p = ProfilePoint(seconds=1.0, repeats=3, **job)
        wobble = 1.0 + noise * math.sin(2.3 * i)  # deterministic "measurement noise"
        points.append(p.model_copy(update={"seconds": predict_point(cm, p, dtype_bytes=4) * wobble}))
    return points


def synthetic_profile(noise: float = 0.0) -> Profile:
    return Profile(name="synthetic", fingerprint=Fingerprint(devices=2, dtype="float32"), hardware=START_HW,
                   points=synthetic_points(noise))


def true_value(key: str) -> float:
    where, field = key.split(".")
    return getattr({"hardware": TRUE_HW, "params": TRUE_PARAMS, "overheads": TRUE_OVERHEADS}[where], field)


@pytest.fixture(scope="module")
def exact_fit() -> Calibration:
    return calibrate(synthetic_profile())


def test_fit_recovers_known_parameters(exact_fit):
    for key in RECOVERED:
        # the FSDP hook overhead trades a little against fsdp_overlap (both price dp > 1 passes)
        rel = 0.05 if key == "overheads.dp_layer_seconds" else 0.02
        assert exact_fit.terms[key] == pytest.approx(true_value(key), rel=rel), key
    for op, err in exact_fit.errors.items():
        assert err.median < 5e-3 and err.max < 2e-2, op
    assert exact_fit.converged


def test_fit_under_noise_reports_the_noise_per_op_kind():
    cal = calibrate(synthetic_profile(noise=0.05))
    for key in ("hardware.peak_flops", "hardware.intra_node_bandwidth", "params.decode_step_overhead",
                "overheads.tp_layer_seconds"):
        assert cal.terms[key] == pytest.approx(true_value(key), rel=0.25), key
    for op, err in cal.errors.items():
        assert err.max < 0.12, op  # the points wobble by at most 5 %
    assert max(e.median for e in cal.errors.values()) > 0.005  # …and the report shows it


def test_a_profile_naming_its_cache_fits_how_fast_decode_reads_it():
    """A CPU profile's Fingerprint.cache_bytes (fp32 bytes) sets decode_cache_bytes (bf16-equivalent) and the fit
    recovers cache_read_speedup from the generate points; a profile that names no cache prices none."""
    # the two smaller models' steps fit the cache (the largest's 6 MB of weights do not); on the truth's device a
    # step of 4 rows reads its weights in twice its compute, so a speedup past 2 would hide under the compute
    truth = TRUE_PARAMS.model_copy(update={"decode_cache_bytes": 4e6, "cache_read_speedup": 1.6})
    points = synthetic_points(params=truth)
    cal = calibrate(Profile(name="cached", fingerprint=Fingerprint(devices=2, dtype="float32", cache_bytes=8_000_000),
                            hardware=START_HW, points=points))
    assert cal.params.decode_cache_bytes == 4e6
    assert cal.terms["params.cache_read_speedup"] == pytest.approx(1.6, rel=0.05)
    assert cal.errors["generate"].max < 2e-2
    blind = calibrate(Profile(name="blind", fingerprint=Fingerprint(devices=2, dtype="float32"), hardware=START_HW,
                              points=points))
    assert "params.cache_read_speedup" not in blind.terms and blind.params.decode_cache_bytes == 0.0
    no_decode = calibrate(Profile(name="cached", fingerprint=Fingerprint(devices=2, dtype="float32", cache_bytes=8_000_000),
                                  hardware=START_HW, points=points), ops=("train", "forward"))
    assert no_decode.params.cache_read_speedup == 1.0  # nothing measured it: no speedup assumed


def test_fit_only_moves_terms_the_points_can_see():
    compute_only = Profile(name="fwd", fingerprint=Fingerprint(devices=1), hardware=START_HW,
                           points=[p for p in synthetic_points() if p.op == "forward" and p.parallel.world_size == 1])
    cal = calibrate(compute_only, terms=(Term("hardware", "peak_flops", 1e8, 1e14),
                                         Term("hardware", "intra_node_bandwidth", 1e6, 1e12)))
    assert "hardware.intra_node_bandwidth" not in cal.terms  # no collective on one device
    assert cal.hardware.intra_node_bandwidth == START_HW.intra_node_bandwidth


def test_calibrated_model_prices_a_plan_like_the_truth(exact_fit):
    plan = Plan.model_validate({
        "algorithm": "ppo", "cluster": {"hardware": START_HW.model_dump(), "nodes": 1, "devices_per_node": 2},
        "workload": {"prompts": 16, "prompt_len": 16, "response_len": 16, "micro_batch_size": 4},
        "groups": [{"name": "a", "devices": [{"node": 0, "index": 0}]}, {"name": "c", "devices": [{"node": 0, "index": 1}]}],
        "roles": {"actor": {"model": MODELS[1].model_dump(), "group": "a"},
                  "ref": {"model": MODELS[1].model_dump(), "group": "a"},
                  "critic": {"model": MODELS[1].model_dump(), "group": "c"},
                  "reward": {"model": MODELS[1].model_dump(), "group": "c"}},
    })
    moved, cm, _ = plan_on_profile(plan, exact_fit)
    assert isinstance(cm, ProfiledCostModel) and moved.cluster.hardware.name == "cpu-x"
    truth = ProfiledCostModel(moved.cluster.model_copy(update={"hardware": TRUE_HW}), TRUE_PARAMS, TRUE_OVERHEADS)
    fitted, true = simulate(moved, cm), simulate(moved, truth)
    assert fitted.iteration_seconds(0) == pytest.approx(true.iteration_seconds(0), rel=0.02)
    for op, s in true.op_seconds(0).items():
        assert fitted.op_seconds(0)[op] == pytest.approx(s, rel=0.03, abs=1e-6), op
    # the overheads show in the breakdown and the parts still add up
    gen = next(e for e in fitted.events if e.op == "generate")
    assert gen.breakdown["overhead"] > 0
    assert sum(gen.breakdown.values()) == pytest.approx(gen.seconds)


def test_zero_overheads_leave_the_analytic_model_unchanged():
    cluster = ClusterSpec(hardware=TRUE_HW, nodes=1, devices_per_node=2)
    plain, profiled = CostModel(cluster, TRUE_PARAMS), ProfiledCostModel(cluster, TRUE_PARAMS)
    for p in synthetic_points():
        if p.op != "reshard":
            assert predict_point(profiled, p) == predict_point(plain, p)


def test_files_and_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path / "cache"))
    path = synthetic_profile().save(tmp_path / "synthetic.json")
    cal = calibrate_file(path)
    assert list((tmp_path / "cache").glob("calibration-*.json"))  # fitted once, cached on disk
    assert calibrate_file(path) is cal
    cm = cost_model_from_profile(str(path), ClusterSpec(hardware=TRUE_HW, nodes=2, devices_per_node=4))
    assert cm.cluster.nodes == 2 and cm.cluster.hardware == cal.hardware
    empty = Profile(name="empty", fingerprint=Fingerprint(), hardware=START_HW,
                    points=[ProfilePoint(op="matmul", size_bytes=512, seconds=0.01)])
    with pytest.raises(HflowError, match="no points of kinds"):
        calibrate(empty)


def test_the_engines_reshard_gathers_over_dp_first_and_copies():
    """Table 2 moves nothing between equal layouts; the FSDP engine still all-gathers each tensor shard
    over dp and copies the generation weights (profiled_cost.ProfiledCostModel.reshard)."""
    cluster = ClusterSpec(hardware=TRUE_HW, nodes=1, devices_per_node=2)
    cm = ProfiledCostModel(cluster, TRUE_PARAMS, TRUE_OVERHEADS)
    m = MODELS[1]
    m_bytes = 2 * m.num_params("lm")
    dp2 = ParallelConfig(dp=2)
    assert CostModel(cluster, TRUE_PARAMS).reshard(m, dp2, dp2, "hybridflow").bytes == 0.0
    c = cm.reshard(m, dp2, dp2, "hybridflow")
    assert c.bytes == pytest.approx(m_bytes / 2)
    link = TRUE_HW.intra_node_bandwidth  # efficiency pinned at 1
    assert c.breakdown["dp_gather"] == pytest.approx(0.5 * m_bytes / link)
    assert c.breakdown["latency"] == pytest.approx((m.layers + 1) * TRUE_HW.intra_node_latency)
    assert c.breakdown["copy"] == pytest.approx(m_bytes / TRUE_HW.hbm_bandwidth)
    assert c.breakdown["overhead"] == pytest.approx(m.layers * TRUE_OVERHEADS.dp_gather_layer_seconds)
    assert sum(c.breakdown.values()) == pytest.approx(c.seconds)
    # a tp=2 → dp=2 switch has no dp to gather over: Table 2's gather (M/2 per device) and the copy
    tp = cm.reshard(m, ParallelConfig(tp=2), dp2, "hybridflow")
    assert tp.bytes == pytest.approx(m_bytes / 2) and "dp_gather" not in tp.breakdown
    assert tp.breakdown["overhead"] == pytest.approx(m.layers * TRUE_OVERHEADS.reshard_layer_seconds)


def test_dispatch_gaps_are_measured_and_the_schedule_leaves_them(exact_fit):
    """'dispatch' points set the controller's gaps as measured (no fit); a simulated op starts that
    long after the input it waited for, or after the op before it on its lane."""
    dep, queued = 0.01, 0.004
    points = synthetic_points() + [
        ProfilePoint(op="dispatch", mode=mode, batch=16, prompt_len=24, group_size=2, seconds=s)
        for mode, s in (("dependent", dep), ("dependent", 3 * dep), ("queued", queued))]
    cal = calibrate(synthetic_profile().model_copy(update={"points": points}))
    assert cal.overheads.dispatch_seconds == pytest.approx(2 * dep)  # the median of what was measured
    assert cal.overheads.queued_call_seconds == pytest.approx(queued)
    assert cal.errors["forward"].max < 2e-2  # the fit itself is untouched by the gaps
    plan = Plan.model_validate({
        "algorithm": "ppo", "cluster": {"hardware": START_HW.model_dump(), "nodes": 1, "devices_per_node": 1},
        "workload": {"prompts": 8, "prompt_len": 16, "response_len": 16, "micro_batch_size": 4},
        "groups": [{"name": "all", "devices": [{"node": 0, "index": 0}]}],
        "roles": {r: {"model": MODELS[0].model_dump(), "group": "all"} for r in ("actor", "ref", "critic", "reward")},
    })
    moved, cm, _ = plan_on_profile(plan, cal)
    tl = simulate(moved, cm)
    by_op = {e.op: e for e in tl.events}
    assert by_op["generate"].start == pytest.approx(by_op["reshard"].end)  # one call: reshard, then generate
    assert by_op["ref_logprob"].start - by_op["generate"].end == pytest.approx(2 * dep)  # waited for its input
    # on the one lane, in the runtime's call order (loops.py: ref, actor, values), each queued behind the one before
    assert by_op["actor_logprob"].start - by_op["ref_logprob"].end == pytest.approx(queued)
    assert by_op["values"].start - by_op["actor_logprob"].end == pytest.approx(queued)
    assert by_op["reward"].start - by_op["values"].end == pytest.approx(queued)
    assert by_op["advantage"].start == pytest.approx(by_op["reward"].end)  # the driver's own op: no gap
    no_gap, _, _ = plan_on_profile(plan, exact_fit)
    assert tl.iteration_seconds(0) > simulate(no_gap, exact_fit.cost_model(no_gap.cluster)).iteration_seconds(0)



def test_reward_points_price_the_rule_based_reward_as_measured():
    """'reward' points set the rule-based reward's seconds per sequence (the median over the tasks, no fit);
    a plan's reward op on the driver is priced by it, its sequences times that."""
    points = synthetic_points() + [ProfilePoint(op="reward", mode=task, batch=128, response_len=8, seconds=s)
                                   for task, s in (("sort", 1.28e-3), ("add", 2.56e-3), ("sort", 6.4e-3))]
    cal = calibrate(synthetic_profile().model_copy(update={"points": points}))
    assert cal.params.rule_reward_seconds_per_sequence == pytest.approx(2e-5)
    assert cal.errors["forward"].max < 2e-2  # the fit itself is untouched
    default = calibrate(synthetic_profile())
    assert default.params.rule_reward_seconds_per_sequence == EfficiencyParams().rule_reward_seconds_per_sequence
    plan = Plan.model_validate({
        "algorithm": "grpo", "cluster": {"hardware": START_HW.model_dump(), "nodes": 1, "devices_per_node": 1},
        "workload": {"prompts": 8, "samples_per_prompt": 4, "prompt_len": 16, "response_len": 16, "micro_batch_size": 4},
        "reward_function": "hybridflow.runtime.tasks.builtin:sort_reward",
        "groups": [{"name": "all", "devices": [{"node": 0, "index": 0}]}],
        "roles": {r: {"model": MODELS[0].model_dump(), "group": "all"} for r in ("actor", "ref")},
    })
    moved, cm, _ = plan_on_profile(plan, cal)
    reward = next(e for e in simulate(moved, cm).events if e.op == "reward")
    assert reward.seconds == pytest.approx(32 * 2e-5)

TRUE_MEGATRON = TRUE_OVERHEADS.model_copy(update=dict(
    megatron_layer_seconds=6e-4, megatron_backward_layer_seconds=1.5e-3, megatron_tp_layer_seconds=5e-3,
    megatron_tp_backward_layer_seconds=8e-3, megatron_pp_seconds=2e-3, megatron_call_seconds=1e-2,
    megatron_step_seconds=4e-3, megatron_backward_ratio=2.5))


def megatron_points() -> list[ProfilePoint]:
    """The megatron engine's points (as `hflow-plan profile --megatron` measures them) priced by the truth."""
    cm = ProfiledCostModel(ClusterSpec(hardware=TRUE_HW, nodes=1, devices_per_node=2), TRUE_PARAMS, TRUE_MEGATRON)
    points = []
    for m in MODELS[:2]:
        for par in ({"dp": 2}, {"tp": 2}, {"pp": 2}):
            for b, s, mb, steps in ((8, 32, 8, 1), (16, 24, 8, 2), (32, 64, 16, 2)):
                shape = dict(model=m, parallel=ParallelConfig(backend="megatron", **par), batch=b, micro_batch=mb,
                             prompt_len=s // 2, response_len=s // 2, seconds=1.0)
                for p in (ProfilePoint(op="megatron_forward", **shape),
                          ProfilePoint(op="megatron_train", steps=steps, **shape)):
                    points.append(p.model_copy(update={"seconds": predict_point(cm, p)}))
    return points


def test_megatron_points_fit_their_own_terms_and_leave_the_rest(exact_fit):
    cal = calibrate(synthetic_profile().model_copy(update={"points": synthetic_points() + megatron_points()}))
    # the second stage moves the megatron terms only: every other figure is the FSDP-only fit's
    assert {k: v for k, v in cal.terms.items() if ".megatron_" not in k} == exact_fit.terms
    for key in (k for k in cal.terms if ".megatron_" in k):
        assert cal.terms[key] == pytest.approx(getattr(TRUE_MEGATRON, key.split(".")[1]), rel=0.05), key
    assert cal.errors["megatron_train"].max < 2e-2 and cal.errors["megatron_forward"].max < 2e-2
    assert cal.overheads.megatron_fitted and not exact_fit.overheads.megatron_fitted
    # a Megatron role: priced with its engine's fitted terms, or (a profile without them) by the analytic model
    cluster = exact_fit.cluster(nodes=1, devices_per_node=2)
    w = Workload(prompts=16, prompt_len=16, response_len=16, micro_batch_size=4, mini_batches=2)
    par = ParallelConfig(tp=2, backend="megatron")
    fitted = cal.cost_model(cluster).train(MODELS[1], "lm", par, w).seconds
    fallback = exact_fit.cost_model(cluster).train(MODELS[1], "lm", par, w).seconds
    assert fallback == CostModel(cluster, exact_fit.params).train(MODELS[1], "lm", par, w).seconds
    truth = ProfiledCostModel(cluster.model_copy(update={"hardware": TRUE_HW}), TRUE_PARAMS, TRUE_MEGATRON)
    assert fitted == pytest.approx(truth.train(MODELS[1], "lm", par, w).seconds, rel=0.02)
    assert fitted > 1.5 * fallback
    # FSDP roles are priced as before
    fsdp = ParallelConfig(tp=2)
    assert (cal.cost_model(cluster).train(MODELS[1], "lm", fsdp, w).seconds
            == exact_fit.cost_model(cluster).train(MODELS[1], "lm", fsdp, w).seconds)
