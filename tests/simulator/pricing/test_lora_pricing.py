"""LoRA priced (vocabulary/lora.py): memory, compute, the weight sync's bytes, the reference folded into the actor."""

import math

import pytest

from hybridflow.simulator import (
    ClusterSpec,
    DeviceGroup,
    Plan,
    RolePlan,
    Workload,
    hardware_preset,
    model_preset,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.memory import OPTIMIZER_BYTES, state_bytes, train_transient
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_bytes, adapter_params
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.units import BF16

M7 = model_preset("llama2-7b")
CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
DEVICES = [{"node": 0, "index": i} for i in range(8)]


def test_adapter_params_count_rank_times_in_plus_out_per_wrapped_layer():
    lora = LoraConfig(rank=16)
    h, f = M7.hidden, M7.ffn  # llama2-7b: no GQA, so q, k, v, o are all h x h
    per_layer = 16 * (4 * (h + h) + 2 * (h + f) + (f + h))
    assert adapter_params(M7, lora) == M7.layers * per_layer == 39_976_960  # peft's count for llama2-7b r=16
    assert adapter_bytes(M7, lora) == BF16 * 39_976_960
    attn = LoraConfig(rank=8, target_modules=("q_proj", "v_proj"))
    assert adapter_params(M7, attn) == M7.layers * 8 * 2 * (h + h)
    assert LoraConfig(rank=8).scale == 2.0 and LoraConfig(rank=8, alpha=8).scale == 1.0


def test_family_defaults_and_unknown_targets():
    mix = model_preset("mixtral-8x7b")
    assert LoraConfig().targets(mix) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert "down_proj" in LoraConfig().targets(M7)
    assert LoraConfig(target_modules=("w1",)).problems(mix) == []
    (bad,) = LoraConfig(target_modules=("qkv",)).problems(M7)
    assert "qkv" in bad and "q_proj" in bad


def test_lora_states_keep_optimizer_and_gradients_for_adapters_only():
    cfg = ParallelConfig(dp=8)
    lora = LoraConfig(rank=16)
    a, n = adapter_params(M7, lora), M7.num_params()
    full, lo = state_bytes(M7, "lm", cfg, True), state_bytes(M7, "lm", cfg, True, lora=lora)
    assert lo.weights == pytest.approx(BF16 * (n + a) / 8)
    assert lo.optimizer == pytest.approx(OPTIMIZER_BYTES * a / 8)
    assert full.optimizer == pytest.approx(OPTIMIZER_BYTES * n / 8)
    w = Workload()
    tf, tl = train_transient(M7, "lm", cfg, w), train_transient(M7, "lm", cfg, w, lora=lora)
    assert tl.activations == tf.activations  # the backward still runs through every layer
    assert tl.gradients == pytest.approx(BF16 * a / 8)
    assert tl.buffers < tf.buffers  # no full-size gradient to reduce-scatter


def test_lora_training_costs_two_passes_of_compute_not_three():
    cm = CostModel(CLUSTER)
    cfg, w = ParallelConfig(dp=8), Workload()
    full = cm.train(M7, "lm", cfg, w)
    lora = cm.train(M7, "lm", cfg, w, lora=LoraConfig(rank=16))
    ratio = lora.flops / full.flops
    assert 2 / 3 < ratio < 2 / 3 + 0.02  # 2 forwards' worth + the adapters' own 6 FLOPs per parameter and token
    assert lora.breakdown["compute"] < full.breakdown["compute"]
    assert lora.breakdown["optimizer"] < full.breakdown["optimizer"] / 100


def _plan(lora: LoraConfig | None, rollout="native", ref=False) -> Plan:
    roles = {"actor": RolePlan(model=M7, group="all", train=ParallelConfig(tp=2, dp=4),
                               generate=ParallelConfig(tp=2, dp=4), rollout=rollout, lora=lora)}
    if ref:
        roles["ref"] = RolePlan(model=M7, group="all", train=ParallelConfig(dp=8))
    return Plan(algorithm="grpo", cluster=CLUSTER, groups=[DeviceGroup(name="all", devices=DEVICES)], roles=roles,
                reward_function="m:f").validate_parallel()


def test_lora_plan_folds_the_reference_into_the_actor():
    plan = _plan(LoraConfig(rank=16))
    assert plan.ref_from_actor and plan.lora_rollout() == "merged"
    assert _plan(LoraConfig(rank=16), rollout="vllm").lora_rollout() == "adapter"
    events = {e.op: e for e in simulate(plan).events}
    assert events["ref_logprob"].role == "actor"
    full = {e.op: e for e in simulate(_plan(None, ref=True)).events}
    assert events["ref_logprob"].end - events["ref_logprob"].start == pytest.approx(
        events["actor_logprob"].end - events["actor_logprob"].start)
    assert full["ref_logprob"].role == "ref" and "ref" not in {e.role for e in simulate(plan).events}
    mem = plan_memory(plan)
    assert set(mem) == {"actor"}
    full_mem = plan_memory(_plan(None, ref=True))
    # the KV cache fills what is free: without Adam's states for the base and without a ref, more sequences decode
    assert mem["actor"].decode_batch > full_mem["actor"].decode_batch
    assert mem["actor"].own.optimizer < full_mem["actor"].own.optimizer / 100


def test_lora_weight_sync_moves_the_adapter_bytes():
    lora = LoraConfig(rank=16)
    for rollout in ("native", "vllm"):
        plan = _plan(lora, rollout=rollout)
        (sync,) = [e for e in simulate(plan).events if e.op == "reshard"]
        assert sync.bytes == adapter_bytes(M7, lora)
        assert price_op(CostModel(CLUSTER), plan, "reshard", "actor").bytes == adapter_bytes(M7, lora)
    # to separate rollout devices: a broadcast of the adapters
    cm = CostModel(CLUSTER)
    b = cm.reshard(M7, ParallelConfig(dp=4), ParallelConfig(dp=4), "broadcast", lora=lora)
    assert b.bytes == adapter_bytes(M7, lora)
    assert b.seconds < cm.reshard(M7, ParallelConfig(dp=4), ParallelConfig(dp=4), "broadcast").seconds / 10


def test_lora_plan_refusals_are_one_line():
    with pytest.raises(HflowError, match="drop the 'ref' role"):
        Plan.from_json_text(_plan(LoraConfig(), ref=False).model_copy(update={"roles": {
            **_plan(LoraConfig()).roles, "ref": RolePlan(model=M7, group="all", train=ParallelConfig(dp=8))}})
            .model_dump_json())
    bad = _plan(None, ref=True).model_dump(mode="json")
    bad["roles"]["ref"]["lora"] = {"rank": 4}
    with pytest.raises(HflowError, match="role 'ref' is not trained"):
        Plan.from_json_text(__import__("json").dumps(bad))
    meg = _plan(LoraConfig()).model_dump(mode="json")
    meg["roles"]["actor"]["train"]["backend"] = "megatron"
    with pytest.raises(HflowError, match="LoRA trains on the fsdp backend only"):
        Plan.from_json_text(__import__("json").dumps(meg))
    tgt = _plan(LoraConfig()).model_dump(mode="json")
    tgt["roles"]["actor"]["lora"]["target_modules"] = ["q"]
    with pytest.raises(HflowError, match="not linear layers of a llama model"):
        Plan.from_json_text(__import__("json").dumps(tgt))


def test_70b_lora_fits_where_full_fine_tuning_does_not():
    m = model_preset("llama2-70b")
    cfg = ParallelConfig(tp=8)
    full = state_bytes(m, "lm", cfg, True).total
    lora = state_bytes(m, "lm", cfg, True, lora=LoraConfig(rank=16)).total
    assert full > hardware_preset("a100-80g").hbm_bytes > lora
    assert math.isclose(lora, BF16 * (m.num_params() + adapter_params(m, LoraConfig(rank=16))) / 8
                        + OPTIMIZER_BYTES * adapter_params(m, LoraConfig(rank=16)) / 8)
    assert isinstance(m, ModelSpec)
