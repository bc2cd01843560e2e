"""`backend: megatron` in the simulator: Megatron's distributed optimizer priced apart from FSDP's gathers
(time and memory), and the plan's train.backend validated."""

import pytest
from sim_util import make_plan

from hybridflow.simulator import ClusterSpec, ParallelConfig, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.cost import BF16, CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import forward_transient, state_bytes, train_transient

A100 = hardware_preset("a100-80g")
LLAMA7 = model_preset("llama2-7b")
W = Workload(prompts=64, prompt_len=512, response_len=512, micro_batch_size=4, mini_batches=2)


def cm():
    return CostModel(ClusterSpec(hardware=A100, nodes=1, devices_per_node=8), EfficiencyParams())


def test_megatron_moves_weights_once_per_step_and_nothing_in_forward():
    fsdp, meg = ParallelConfig(tp=2, dp=4), ParallelConfig(tp=2, dp=4, backend="megatron")
    shard = BF16 * LLAMA7.num_params("lm") / 2  # bf16 weights of one tp shard
    steps = W.ppo_epochs * W.mini_batches
    per_rank = -(-W.sequences * W.ppo_epochs // (steps * 4))
    micro = steps * -(-per_rank // W.micro_batch_size)
    # forward: FSDP gathers the weights once per micro-batch, Megatron moves none
    ff, fm = cm().forward(LLAMA7, "lm", fsdp, W), cm().forward(LLAMA7, "lm", meg, W)
    assert "dp_comm" not in fm.breakdown
    assert ff.bytes - fm.bytes == pytest.approx(-(-W.sequences // 4) // W.micro_batch_size * 3 / 4 * shard)
    # training: FSDP gathers twice and reduce-scatters per micro-batch; Megatron's distributed optimizer
    # reduce-scatters the fp32 gradients and gathers the weights once per optimizer step
    f, m = cm().train(LLAMA7, "lm", fsdp, W), cm().train(LLAMA7, "lm", meg, W)
    assert f.bytes - m.bytes == pytest.approx((micro - steps) * 3 * 3 / 4 * shard)
    assert m.breakdown["dp_comm"] > 0
    assert f.breakdown["compute"] == pytest.approx(m.breakdown["compute"])  # the same FLOPs
    assert f.breakdown["tp_comm"] == pytest.approx(m.breakdown["tp_comm"])  # the same TP all-reduces
    one = ParallelConfig(tp=8)  # with dp = 1 the backends cost the same
    assert cm().train(LLAMA7, "lm", one, W).seconds == pytest.approx(
        cm().train(LLAMA7, "lm", one.model_copy(update={"backend": "megatron"}), W).seconds)


def test_megatron_memory_keeps_weights_and_gradients_whole_over_dp():
    fsdp, meg = ParallelConfig(tp=2, dp=4), ParallelConfig(tp=2, dp=4, backend="megatron")
    params = LLAMA7.num_params("lm")
    f, m = state_bytes(LLAMA7, "lm", fsdp, True), state_bytes(LLAMA7, "lm", meg, True)
    assert m.weights == pytest.approx(2 * params / 2) and f.weights == pytest.approx(2 * params / 8)
    assert m.optimizer == pytest.approx(f.optimizer)  # the distributed optimizer shards the states alike
    # megatron-core's fp32 gradient buffer is allocated with the model and stays (through generation): a state
    assert m.gradients == pytest.approx(4 * params / 2) and f.gradients == 0
    assert state_bytes(LLAMA7, "lm", meg, False).gradients == 0  # a frozen model has none
    assert state_bytes(LLAMA7, "lm", meg, True, optimizer_offload=True).gradients == 0  # ZeRO-Offload: in host memory
    mt, ft = train_transient(LLAMA7, "lm", meg, W), train_transient(LLAMA7, "lm", fsdp, W)
    assert mt.gradients == 0 and mt.buffers == 0 < ft.buffers
    assert forward_transient(LLAMA7, "lm", meg, W).buffers == 0


def test_plan_carries_train_backend_and_refuses_it_on_generation():
    plan = make_plan()
    actor = plan.roles["actor"]
    roles = {**plan.roles, "actor": actor.model_copy(update={"train": actor.train.model_copy(
        update={"backend": "megatron"})})}
    again = type(plan).model_validate_json(plan.model_copy(update={"roles": roles}).model_dump_json())
    assert again.roles["actor"].train.backend == "megatron" and again.roles["ref"].train.backend == "fsdp"
    data = plan.model_dump()
    data["roles"]["actor"]["generate"] = {**(data["roles"]["actor"]["generate"] or {"tp": 1}), "backend": "megatron"}
    with pytest.raises(ValueError, match="train.backend"):
        type(plan).model_validate(data)
    with pytest.raises(ValueError, match="backend"):
        ParallelConfig(backend="tensorflow")
    assert ParallelConfig(backend="deepspeed").generation_layout().backend == "fsdp"  # priced for baselines only
