"""Another system's engines, priced by what they do (simulator/vocabulary/mechanics.py), on hand-computed values:
the Mechanics a plan names (validation, describe), a static generation batch capping the decode waves' batch,
HF generate under ZeRO-3 gathering the shards at every pass, DS-Chat's one generation (and switch) per PPO
mini-batch and NeMo-Aligner's slower generation loop as price_op applies them to a Plan, ZeRO-Offload of the
optimizer (its time and its memory), OpenRLHF's per-tensor weight sync, the Hybrid Engine's and the in-place
"reshards", and the runtime refusing a plan priced on another system's engines."""

import pytest
from pydantic import ValidationError
from rl_util import tiny_plan

from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import ClusterSpec, ParallelConfig, Plan, Workload
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import OPTIMIZER_BYTES, state_bytes
from hybridflow.simulator.pricing.plan_memory import kv_free_bytes, plan_memory
from hybridflow.simulator.pricing.reshard import HYBRID_ENGINE, IN_PLACE, ReshardSpec, reshard_spec
from hybridflow.simulator.vocabulary.hardware import HardwareSpec
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset
from hybridflow.simulator.vocabulary.units import GiB

# A toy device of round figures (as tests/simulator/pricing/test_gpu_terms.py): 1 TFLOP/s, 100 GB/s HBM,
# 10 GB/s NVLink (10 us), an 8 GB/s NIC per node (20 us), a 25 GB/s host link.
HW = HardwareSpec(name="toy-gpu", peak_flops=1e12, hbm_bandwidth=1e11, hbm_bytes=64 * GiB,
                  intra_node_bandwidth=1e10, inter_node_bandwidth=8e9, intra_node_latency=1e-5,
                  inter_node_latency=2e-5, host_bandwidth=25e9)
# A llama-like toy: 2 layers, hidden 64, 4 heads of 16, MHA, SwiGLU 128 wide, vocabulary 100, untied head.
TOY = ModelSpec(name="toy", layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=100)
LAYER = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v, o; gate, up, down; two norms
PARAMS = 100 * 64 + 2 * LAYER + 64 + 100 * 64  # embedding, layers, final norm, head
M_BYTES = 2 * PARAMS  # the bf16 weights
KV_SEQ_16 = 16 * 2 * 2 * 4 * 16 * 2  # a 16-token sequence's KV cache: tokens · k,v · layers · heads · dim · bf16
# NVLink at half its line rate (5 GB/s), the NIC likewise (4 GB/s): round collective times
LINKS = dict(intra_link_efficiency=0.5, inter_link_efficiency=0.5)


def cluster(nodes=1, per_node=8):
    return ClusterSpec(hardware=HW, nodes=nodes, devices_per_node=per_node)


def test_the_toy_shape_by_hand():
    assert TOY.num_params() == PARAMS and TOY.num_tensors() == 2 * 9 + 3
    assert TOY.kv_bytes_per_token() * 16 == KV_SEQ_16


# ---- Mechanics ----------------------------------------------------------------------------------------
def test_static_batching_needs_a_generation_batch():
    with pytest.raises(ValidationError, match="static batching needs a generation_batch"):
        Mechanics(batching="static")
    assert Mechanics(batching="static", generation_batch=4).generation_batch == 4


def test_continuous_batching_refuses_a_generation_batch():
    with pytest.raises(ValidationError, match="continuous batching fills the KV cache"):
        Mechanics(generation_batch=4)
    with pytest.raises(ValidationError):
        Mechanics(decode_slowdown=0.5)  # a loop faster than the serving engine is no slowdown
    with pytest.raises(ValidationError):
        Mechanics(system="trl")
    with pytest.raises(ValidationError):
        Mechanics(gather_evry_step=True)  # extra="forbid": a misspelt mechanic is an error, not a default


def test_the_default_mechanics_are_hybridflows_own():
    m = Mechanics()
    assert m.is_default and m.describe() == "hybridflow"
    assert (m.system, m.batching, m.generation_batch, m.gather_every_step, m.generate_per_minibatch,
            m.weight_sync, m.decode_slowdown) == ("hybridflow", "continuous", None, False, False, "bucketed", 1.0)
    assert Plan.model_fields["mechanics"].default == m and Plan.model_fields["optimizer_offload"].default is False
    for changed in (Mechanics(system="openrlhf"), Mechanics(weight_sync="per-tensor"), Mechanics(decode_slowdown=2),
                    Mechanics(generate_per_minibatch=True), Mechanics(gather_every_step=True)):
        assert not changed.is_default


def test_describe_names_every_mechanic_that_differs():
    every = Mechanics(system="deepspeed-chat", batching="static", generation_batch=4, gather_every_step=True,
                      generate_per_minibatch=True, weight_sync="per-tensor", decode_slowdown=6.96)
    assert every.describe() == ("deepspeed-chat, static generation batch 4, ZeRO-3 gather every decode step, "
                                "one generation per mini-batch, per-tensor weight sync, "
                                "generation loop 6.96x a serving engine's time")
    assert Mechanics(system="openrlhf", weight_sync="per-tensor").describe() == "openrlhf, per-tensor weight sync"


# ---- batch_cap: a static engine's batch per call --------------------------------------------------------
def waves_workload(prompts=20):
    return Workload(prompts=prompts, prompt_len=8, response_len=8)  # 16-token sequences


@pytest.mark.parametrize(("cap", "expected"), [
    (None, (10, 1, 10)),  # 10 sequences per replica (20 on dp=2): one wave, the KV cache holds them all
    (100, (10, 1, 10)),  # a cap above what the replica is given changes nothing
    (6, (10, 2, 5)),  # two waves, balanced 5 + 5
    (4, (10, 3, 4)),  # three waves of at most 4: 4 + 3 + 3, the balanced batch 4
    (3, (10, 4, 3)),
    (1, (10, 10, 1)),
])
def test_batch_cap_caps_the_wave_batch_and_raises_the_waves(cap, expected):
    cm = CostModel(cluster())
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, None, batch_cap=cap) == expected


def test_batch_cap_never_raises_the_batch_over_what_the_kv_cache_holds():
    cm = CostModel(cluster())
    free = 3 * KV_SEQ_16 + 1  # room for three sequences' KV cache
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, free) == (10, 4, 3)
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, free, batch_cap=5) == (10, 4, 3)
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, free, batch_cap=2) == (10, 5, 2)


def test_generate_with_a_batch_cap_pays_each_waves_passes():
    cm = CostModel(cluster())
    w, gen = waves_workload(), ParallelConfig(dp=2)
    ovh = cm.params.decode_step_overhead
    free, capped = cm.generate(TOY, gen, w), cm.generate(TOY, gen, w, batch_cap=4)
    # the prefill and 7 decode steps per wave, a step's fixed overhead each: 1 wave against 3
    assert free.breakdown["overhead"] == pytest.approx(1 * 8 * ovh)
    assert capped.breakdown["overhead"] == pytest.approx(3 * 8 * ovh)
    assert capped.seconds > free.seconds
    assert capped.flops == free.flops  # the same sequences, the same work: only how they are batched differs


# ---- gather_every_step: HF generate under ZeRO-3 -------------------------------------------------------
@pytest.mark.parametrize(("cap", "waves"), [(None, 1), (1, 2)])
def test_gather_every_step_all_gathers_the_model_at_every_pass(cap, waves):
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    w = Workload(prompts=8, prompt_len=8, response_len=4)  # 2 sequences per replica on dp=4
    gen = ParallelConfig(dp=4)
    plain = cm.generate(TOY, gen, w, batch_cap=cap)
    zero3 = cm.generate(TOY, gen, w, batch_cap=cap, gather_every_step=True)
    passes = waves * 4  # each wave's prefill and its 3 decode steps
    # a ring all-gather of the bf16 model over the 4 ranks at 5 GB/s per pass; 10 us per layer per pass
    assert zero3.breakdown["dp_gather"] == pytest.approx(passes * 0.75 * M_BYTES / 5e9)
    assert zero3.breakdown["latency"] - plain.breakdown.get("latency", 0.0) == pytest.approx(passes * 2 * 1e-5)
    assert "dp_gather" not in plain.breakdown
    assert zero3.seconds - plain.seconds == pytest.approx(passes * (0.75 * M_BYTES / 5e9 + 2 * 1e-5))
    assert zero3.flops == plain.flops


def test_gather_every_step_on_one_replica_gathers_nothing():
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    w = Workload(prompts=8, prompt_len=8, response_len=4)
    for gen in (ParallelConfig(), ParallelConfig(tp=2)):
        plain, zero3 = (cm.generate(TOY, gen, w, gather_every_step=g) for g in (False, True))
        assert zero3.breakdown == plain.breakdown and zero3.seconds == plain.seconds


def test_gather_every_step_over_dp_of_a_tensor_parallel_layout_gathers_the_tp_shard():
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    w = Workload(prompts=8, prompt_len=8, response_len=4)  # 4 sequences per replica: one wave
    gen = ParallelConfig(tp=2, dp=2)  # the dp group (0, 2): a ring of 2 over the tp shard M/2
    zero3 = cm.generate(TOY, gen, w, gather_every_step=True)
    assert zero3.breakdown["dp_gather"] == pytest.approx(4 * 0.5 * (M_BYTES / 2) / 5e9)


# ---- price_op: a plan's mechanics ------------------------------------------------------------------------
def mech_plan(mechanics: Mechanics = Mechanics(), mini_batches: int = 4, **fields) -> Plan:
    """PPO on the tiny preset: actor and ref on 2 devices (training tp 2, generation dp 2), the critic on 1."""
    w = Workload(prompts=16, prompt_len=16, response_len=8, micro_batch_size=2, mini_batches=mini_batches)
    plan = tiny_plan("ppo", devices=[2, 1], train={"actor": ParallelConfig(tp=2), "ref": ParallelConfig(tp=2)},
                     generate=ParallelConfig(dp=2), workload=w)
    return Plan.model_validate({**plan.model_dump(), "mechanics": mechanics.model_dump(), **fields})


def test_a_plans_mechanics_round_trip_and_default():
    plan = mech_plan(Mechanics(system="deepspeed-chat", generate_per_minibatch=True, decode_slowdown=2.0))
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert mech_plan().mechanics.is_default


def test_generate_per_minibatch_generates_each_minibatchs_share_and_switches_each_time():
    cm = CostModel(cluster())
    base, per_mb = mech_plan(), mech_plan(Mechanics(generate_per_minibatch=True))
    model, gen, w = base.roles["actor"].model, base.generation_config(), base.workload
    free = kv_free_bytes(per_mb, cm.params)
    one_call = cm.generate(model, gen, w, 16 // 4, free)  # a quarter of the 16 sequences
    got = price_op(cm, per_mb, "generate", "actor")
    assert got.seconds == pytest.approx(4 * one_call.seconds)
    assert got.flops == pytest.approx(4 * one_call.flops) and got.bytes == pytest.approx(4 * one_call.bytes)
    assert got.breakdown == pytest.approx({k: 4 * v for k, v in one_call.breakdown.items()})
    # the default: one call of all 16
    assert price_op(cm, base, "generate", "actor").seconds == pytest.approx(
        cm.generate(model, gen, w, 16, kv_free_bytes(base, cm.params)).seconds)
    # the switch into the generation layout (and back) is paid once per mini-batch
    switch = cm.reshard(model, base.roles["actor"].train, gen, base.weight_sync_mode())
    assert switch.seconds > 0
    assert price_op(cm, base, "reshard", "actor").seconds == pytest.approx(switch.seconds)
    assert price_op(cm, per_mb, "reshard", "actor").seconds == pytest.approx(4 * switch.seconds)
    assert price_op(cm, per_mb, "reshard", "actor").bytes == pytest.approx(4 * switch.bytes)
    # training is not touched
    for op, role in (("actor_update", "actor"), ("critic_update", "critic"), ("actor_logprob", "actor")):
        assert price_op(cm, per_mb, op, role).seconds == price_op(cm, base, op, role).seconds


def test_generate_per_minibatch_with_one_minibatch_is_one_call():
    cm = CostModel(cluster())
    one, per_mb = mech_plan(mini_batches=1), mech_plan(Mechanics(generate_per_minibatch=True), mini_batches=1)
    for op in ("generate", "reshard"):
        assert price_op(cm, per_mb, op, "actor").seconds == pytest.approx(price_op(cm, one, op, "actor").seconds)


def test_decode_slowdown_multiplies_the_generate_op_only():
    cm = CostModel(cluster())
    base, slow = mech_plan(), mech_plan(Mechanics(decode_slowdown=6.96))
    g0, g1 = price_op(cm, base, "generate", "actor"), price_op(cm, slow, "generate", "actor")
    assert g1.seconds == pytest.approx(6.96 * g0.seconds)
    assert g1.breakdown == pytest.approx({k: 6.96 * v for k, v in g0.breakdown.items()})
    for op, role in (("reshard", "actor"), ("actor_update", "actor"), ("ref_logprob", "ref"), ("values", "critic")):
        assert price_op(cm, slow, op, role).seconds == price_op(cm, base, op, role).seconds
    # with one generation per mini-batch as well: m calls of 1/m of the sequences, each `slowdown` times slower
    both = mech_plan(Mechanics(generate_per_minibatch=True, decode_slowdown=2.0))
    one_call = cm.generate(base.roles["actor"].model, base.generation_config(), base.workload, 4,
                           kv_free_bytes(both, cm.params))
    assert price_op(cm, both, "generate", "actor").seconds == pytest.approx(2.0 * 4 * one_call.seconds)


def test_a_static_batch_and_zero3_generation_reach_the_generate_op():
    cm = CostModel(cluster())
    base = mech_plan()
    static = mech_plan(Mechanics(batching="static", generation_batch=2))
    zero3 = mech_plan(Mechanics(batching="static", generation_batch=2, gather_every_step=True))
    model, gen, w = base.roles["actor"].model, base.generation_config(), base.workload
    free = kv_free_bytes(static, cm.params)
    assert price_op(cm, static, "generate", "actor").seconds == pytest.approx(
        cm.generate(model, gen, w, 16, free, batch_cap=2).seconds)
    assert price_op(cm, zero3, "generate", "actor").seconds == pytest.approx(
        cm.generate(model, gen, w, 16, kv_free_bytes(zero3, cm.params), batch_cap=2, gather_every_step=True).seconds)
    assert "dp_gather" in price_op(cm, zero3, "generate", "actor").breakdown
    assert price_op(cm, static, "generate", "actor").seconds > price_op(cm, base, "generate", "actor").seconds


def test_a_plans_weight_sync_mode_follows_its_mechanics():
    assert mech_plan().weight_sync_mode() == "hybridflow"
    assert mech_plan(Mechanics(gather_every_step=True)).weight_sync_mode() == IN_PLACE
    assert mech_plan(Mechanics(system="deepspeed-chat")).weight_sync_mode() == HYBRID_ENGINE
    # ZeRO-3 generation wins over DS-Chat's Hybrid Engine: nothing is switched
    assert mech_plan(Mechanics(system="deepspeed-chat", gather_every_step=True)).weight_sync_mode() == IN_PLACE
    cm = CostModel(cluster())
    assert price_op(cm, mech_plan(Mechanics(gather_every_step=True)), "reshard", "actor").seconds == 0.0
    he = mech_plan(Mechanics(system="deepspeed-chat", generate_per_minibatch=True))
    rp = he.roles["actor"]
    assert price_op(cm, he, "reshard", "actor").seconds == pytest.approx(
        4 * cm.reshard(rp.model, rp.train, he.generation_config(), HYBRID_ENGINE).seconds)


# ---- optimizer_offload -------------------------------------------------------------------------------------
def train_workload():
    return Workload(prompts=32, prompt_len=8, response_len=8, micro_batch_size=2, mini_batches=2, ppo_epochs=2)


@pytest.mark.parametrize(("nodes", "dp", "on_node"), [(1, 4, 4), (2, 16, 8)])
def test_optimizer_offload_steps_adam_on_the_host(nodes, dp, on_node):
    params = EfficiencyParams(host_adam_bandwidth=1e10, host_link_efficiency=0.5, hbm_efficiency=0.5)
    cm = CostModel(cluster(nodes=nodes), params)
    w, par = train_workload(), ParallelConfig(dp=dp)
    steps = 2 * 2  # epochs × mini-batches
    local = PARAMS / dp
    on_device = cm.train(TOY, "lm", par, w)
    offloaded = cm.train(TOY, "lm", par, w, optimizer_offload=True)
    assert on_device.breakdown["optimizer"] == pytest.approx(steps * local * 28 / 5e10)
    assert "optimizer" not in offloaded.breakdown
    # the node's CPU steps its devices' shards one after another: (devices on the node) · local parameters
    assert offloaded.breakdown["host_optimizer"] == pytest.approx(steps * on_node * local * 28 / 1e10)
    # bf16 gradients out and weights back over the host link at 25 GB/s · 0.5
    assert offloaded.breakdown["host_copy"] == pytest.approx(steps * 2 * 2 * local / 12.5e9)
    rest = {k: v for k, v in on_device.breakdown.items() if k != "optimizer"}
    assert {k: v for k, v in offloaded.breakdown.items() if k not in ("host_optimizer", "host_copy")} == rest
    assert offloaded.seconds - on_device.seconds == pytest.approx(
        offloaded.breakdown["host_optimizer"] + offloaded.breakdown["host_copy"] - on_device.breakdown["optimizer"])
    assert offloaded.flops == on_device.flops


def test_price_op_prices_the_update_of_an_offloaded_plan_on_the_host():
    cm = CostModel(cluster())
    base, off = mech_plan(), mech_plan(optimizer_offload=True)
    for op, role in (("actor_update", "actor"), ("critic_update", "critic")):
        a, b = price_op(cm, base, op, role), price_op(cm, off, op, role)
        assert "optimizer" in a.breakdown and "optimizer" not in b.breakdown and "host_optimizer" in b.breakdown
    assert price_op(cm, off, "generate", "actor").flops == price_op(cm, base, "generate", "actor").flops


def test_state_bytes_of_an_offloaded_optimizer():
    par = ParallelConfig(dp=4)
    kept = state_bytes(TOY, "lm", par, True)
    moved = state_bytes(TOY, "lm", par, True, optimizer_offload=True)
    assert kept.weights == moved.weights == pytest.approx(2 * PARAMS / 4)
    assert kept.optimizer == pytest.approx(OPTIMIZER_BYTES * PARAMS / 4)
    assert moved.optimizer == 0.0
    assert kept.total - moved.total == pytest.approx(OPTIMIZER_BYTES * PARAMS / 4)
    # a model that is not trained has no optimizer to move
    assert state_bytes(TOY, "lm", par, False, optimizer_offload=True) == state_bytes(TOY, "lm", par, False)


def test_plan_memory_of_an_offloaded_plan_is_lower_by_the_optimizers_bytes():
    m7 = model_preset("llama2-7b")
    w = Workload(prompts=64, prompt_len=256, response_len=256, micro_batch_size=4, mini_batches=4)
    plan = tiny_plan("ppo", placement=[["actor", "ref", "critic", "reward"]], devices=[8], model=m7, workload=w)
    off = plan.model_copy(update={"optimizer_offload": True})
    kept, moved = plan_memory(plan), plan_memory(off)
    optimizer = OPTIMIZER_BYTES * (m7.num_params("lm") + m7.num_params("scalar")) / 8  # actor's and critic's
    for role in plan.roles:
        assert moved[role].breakdown.optimizer == 0.0
        assert kept[role].bytes_per_device - moved[role].bytes_per_device == pytest.approx(optimizer)
    # the critic's own peak, its update: ZeRO-Offload moves its gradients out as well
    own_kept, own_moved = kept["critic"].own, moved["critic"].own
    assert own_kept.gradients > 0 and own_moved.gradients == 0.0 and own_moved.optimizer == 0.0
    assert own_kept.total - own_moved.total == pytest.approx(own_kept.gradients + own_kept.optimizer)


# ---- per-tensor weight sync -------------------------------------------------------------------------------
@pytest.mark.parametrize(("nodes", "per_node", "gather_lat", "send_lat"), [
    (1, 8, 1e-5, 1e-5),  # 2 trainers + 2 engines on one node: NVLink both
    (2, 2, 1e-5, 2e-5),  # the trainers fill node 0 (gather on NVLink); the send crosses to node 1
])
def test_per_tensor_sync_pays_a_gather_and_a_send_latency_per_tensor(nodes, per_node, gather_lat, send_lat):
    cm = CostModel(cluster(nodes=nodes, per_node=per_node), EfficiencyParams(**LINKS))
    train, gen = ParallelConfig(dp=2), ParallelConfig(tp=2)
    bucketed = cm.reshard(TOY, train, gen, "broadcast")
    per_tensor = cm.reshard(TOY, train, gen, "broadcast", per_tensor=True)
    # bucketed: a gather per layer and one for the rest (3), one bucket's send
    assert bucketed.breakdown["latency"] == pytest.approx(3 * gather_lat + send_lat)
    # per tensor: 21 tensors, each gathered and sent on its own
    assert per_tensor.breakdown["latency"] == pytest.approx(21 * (gather_lat + send_lat))
    assert per_tensor.breakdown["reshard_comm"] == bucketed.breakdown["reshard_comm"]  # the same bytes
    assert per_tensor.bytes == bucketed.bytes == pytest.approx(M_BYTES)


def test_per_tensor_sync_from_one_trainer_pays_only_the_sends():
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    cost = cm.reshard(TOY, ParallelConfig(), ParallelConfig(tp=2), "broadcast", per_tensor=True)
    assert cost.breakdown["latency"] == pytest.approx(21 * 1e-5)


def test_per_tensor_reaches_the_weight_sync_op_of_a_plan():
    cm = CostModel(cluster())
    plan = tiny_plan("grpo", placement=[["actor", "ref"]], devices=[2], generate=ParallelConfig(tp=2))
    from hybridflow.simulator import Device, DeviceGroup

    gen = DeviceGroup(name="gen", devices=[Device(node=0, index=2), Device(node=0, index=3)])
    data = plan.model_dump()
    data["groups"].append(gen.model_dump())
    data["roles"]["actor"]["generate_group"] = "gen"
    data["reshard"] = "broadcast"
    split = Plan.model_validate(data)
    per_tensor = Plan.model_validate({**data, "mechanics": {"system": "openrlhf", "weight_sync": "per-tensor"}})
    rp = split.roles["actor"]
    assert split.weight_sync_mode() == per_tensor.weight_sync_mode() == "broadcast"
    assert price_op(cm, split, "reshard", "actor").seconds == pytest.approx(
        cm.reshard(rp.model, rp.train, split.generation_config(), "broadcast").seconds)
    assert price_op(cm, per_tensor, "reshard", "actor").seconds == pytest.approx(
        cm.reshard(rp.model, rp.train, split.generation_config(), "broadcast", per_tensor=True).seconds)
    assert price_op(cm, per_tensor, "reshard", "actor").seconds > price_op(cm, split, "reshard", "actor").seconds


# ---- the Hybrid Engine's gather and generation in place -----------------------------------------------------
@pytest.mark.parametrize(("train", "gen", "n", "mp_g"), [
    (ParallelConfig(dp=8), ParallelConfig(tp=2, dp=4), 8, 2),
    (ParallelConfig(dp=8), ParallelConfig(tp=8), 8, 8),
    (ParallelConfig(tp=2, dp=4), ParallelConfig(tp=4, dp=2), 8, 4),
    (ParallelConfig(dp=16), ParallelConfig(dp=16), 16, 1),
])
def test_hybrid_engine_spec_gathers_the_whole_model_and_keeps_an_inference_tp_slice(train, gen, n, mp_g):
    M = 1000.0
    spec = reshard_spec(M, train, gen, HYBRID_ENGINE)
    assert spec.volume == pytest.approx((n - 1) / n * M)
    assert spec.peak_memory == pytest.approx(M / mp_g)
    assert spec.redundancy == pytest.approx(M / n)
    assert spec.gathered_bytes == M and spec.ranks == tuple(range(n))
    # Table 2's ds-chat moves the same bytes but peaks at the whole model
    ds = reshard_spec(M, train, gen, "ds-chat")
    assert ds.volume == spec.volume and ds.peak_memory == M


def test_in_place_spec_moves_nothing():
    assert reshard_spec(1000.0, ParallelConfig(dp=8), ParallelConfig(dp=8), IN_PLACE) == ReshardSpec(
        0.0, 0.0, 0.0, 0.0, (0,))


def test_hybrid_engine_reshard_prices_the_gather_over_every_device():
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    cost = cm.reshard(TOY, ParallelConfig(dp=8), ParallelConfig(tp=2, dp=4), HYBRID_ENGINE)
    assert cost.breakdown["reshard_comm"] == pytest.approx(7 / 8 * M_BYTES / 5e9)
    assert cost.breakdown["latency"] == pytest.approx(3 * 1e-5)  # a gather per layer and one for the rest
    assert cost.bytes == pytest.approx(7 / 8 * M_BYTES)


@pytest.mark.parametrize("train", [ParallelConfig(dp=8), ParallelConfig(tp=2, dp=4)])
def test_in_place_reshard_costs_nothing_analytic_or_profiled(train):
    gen = ParallelConfig(dp=8)
    for cm in (CostModel(cluster()),
               ProfiledCostModel(cluster(), EfficiencyParams(),
                                 EngineOverheads(call_seconds=1e-3, dp_gather_layer_seconds=1e-3,
                                                 weight_tensor_seconds=1e-3))):
        cost = cm.reshard(TOY, train, gen, IN_PLACE)
        assert cost.seconds == 0.0 and cost.bytes == 0.0 and cost.flops == 0.0
        assert sum(cost.breakdown.values()) == 0.0
        assert cm.reshard(TOY, train, gen, IN_PLACE, per_tensor=True).seconds == 0.0
    # the same overheads do price a real switch
    profiled = ProfiledCostModel(cluster(), EfficiencyParams(), EngineOverheads(call_seconds=1e-3))
    assert profiled.reshard(TOY, train, gen, HYBRID_ENGINE).seconds > 0.0


def test_an_unknown_reshard_mode_is_refused():
    with pytest.raises(HflowError, match="unknown reshard mode 'in_place'"):
        reshard_spec(1000.0, ParallelConfig(), ParallelConfig(), "in_place")


# ---- the runtime runs only HybridFlow's own engines ------------------------------------------------------------
@pytest.mark.parametrize("mechanics", [
    Mechanics(system="deepspeed-chat", batching="static", generation_batch=2, generate_per_minibatch=True),
    Mechanics(system="openrlhf", weight_sync="per-tensor"),
    Mechanics(system="nemo-aligner", batching="static", generation_batch=8, decode_slowdown=6.96),
    Mechanics(gather_every_step=True),  # hybridflow's name, another engine's behaviour
])
def test_check_runnable_refuses_a_plan_priced_on_another_systems_engines(mechanics):
    check_runnable(mech_plan(), RunConfig())  # the default mechanics run
    with pytest.raises(HflowError) as e:
        check_runnable(mech_plan(mechanics), RunConfig())
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("this plan is priced with another system's engines")
    assert mechanics.describe() in msg
