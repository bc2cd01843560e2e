"""Other systems' mechanics that move states and weights (simulator/vocabulary/mechanics.py), on hand-computed
values: ZeRO-Offload of the optimizer (its time and its memory), OpenRLHF's per-tensor weight sync, the Hybrid
Engine's and the in-place "reshards", and the runtime refusing a plan priced on another system's engines."""

import pytest
from pricing_toys import HW as TOY_GPU
from pricing_toys import LINKS, M_BYTES, PARAMS, TOY, mech_plan
from pricing_toys import cluster as toy_cluster
from rl_util import tiny_plan

from hybridflow.runtime.rl.plan_support import check_runnable
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import ParallelConfig, Plan, Workload
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import OPTIMIZER_BYTES, state_bytes
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.pricing.reshard import HYBRID_ENGINE, IN_PLACE, ReshardSpec, reshard_spec
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.model import model_preset

HW = TOY_GPU.model_copy(update={"host_bandwidth": 25e9})  # a 25 GB/s host link


def cluster(nodes=1, per_node=8):
    return toy_cluster(nodes, per_node, HW)


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
