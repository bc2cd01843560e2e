"""Expert parallelism in the cost model (simulator/pricing/expert_parallel.py): each MoE layer's dispatch and combine
all-to-alls over the ep ranks, the experts' gradients reduced over dp/ep ranks, and the fp32 gradient
buffer split like the weights; ep = 1 and dense models price without any of it."""

import pytest

from hybridflow.simulator import ClusterSpec, ParallelConfig, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.comm import alltoall_seconds, ep_ranks, expert_dp_ranks
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.memory import state_bytes

A100 = hardware_preset("a100-80g")
MIXTRAL = model_preset("mixtral-8x7b")
W = Workload(prompts=64, prompt_len=512, response_len=512, micro_batch_size=4, mini_batches=2)
P = EfficiencyParams()
NVLINK = A100.intra_node_bandwidth * P.intra_link_efficiency  # the ep ranks sit in one node here


def cm(nodes=1):
    return CostModel(ClusterSpec(hardware=A100, nodes=nodes, devices_per_node=8), P)


def meg(**kw):
    return ParallelConfig(backend="megatron", **kw)


def test_alltoall_sends_all_but_the_own_share():
    # 1 GB per device over 4 devices at 50 GB/s: 3/4 GB sent each → 15 ms, plus latency
    assert alltoall_seconds(1e9, 4, 50e9, 1e-5) == pytest.approx(0.015 + 1e-5)
    assert alltoall_seconds(1e9, 1, 50e9, 1e-5) == 0.0
    par = meg(tp=2, dp=8, ep=4)
    assert ep_ranks(par) == (0, 2, 4, 6) and expert_dp_ranks(par) == (0, 8)


def test_dispatch_by_hand_forward_and_train():
    par = meg(dp=8, ep=4)
    per_rank = W.sequences // 8  # 8 sequences per dp rank: 2 micro-batches of 4
    b, micro = W.micro_batch_size, per_rank // W.micro_batch_size
    size = 2 * b * W.seq_len * MIXTRAL.experts_per_token * MIXTRAL.hidden  # bf16 top-k hidden vectors
    one = 3 / 4 * size  # each all-to-all keeps an ep-th of them
    lat = A100.intra_node_latency
    fwd = cm().forward(MIXTRAL, "lm", par, W)
    # forward: a dispatch and a combine per MoE layer per micro-batch; Megatron's forward moves nothing else
    assert fwd.breakdown["ep_comm"] == pytest.approx(micro * 2 * MIXTRAL.layers * one / NVLINK)
    assert fwd.breakdown["latency"] == pytest.approx(micro * 2 * MIXTRAL.layers * lat)
    base = cm().forward(MIXTRAL, "lm", meg(dp=8), W)
    assert "ep_comm" not in base.breakdown
    assert fwd.bytes - base.bytes == pytest.approx(micro * 2 * MIXTRAL.layers * one)
    assert fwd.breakdown["compute"] == base.breakdown["compute"]  # balanced routing: the same FLOPs per device
    assert fwd.seconds - base.seconds == pytest.approx(micro * 2 * MIXTRAL.layers * (one / NVLINK + lat))
    # training: twice that with the backward, three times with recomputation (the forward redone)
    steps = W.ppo_epochs * W.mini_batches
    t_micro = steps * -(-(W.sequences * W.ppo_epochs // (steps * 8)) // b)
    for recompute, per_layer in ((False, 4), (True, 6)):
        tr = cm().train(MIXTRAL, "lm", par, W, recompute=recompute)
        assert tr.breakdown["ep_comm"] == pytest.approx(t_micro * per_layer * MIXTRAL.layers * one / NVLINK)


def test_megatron_reduces_the_experts_over_dp_over_ep_ranks():
    par = meg(dp=8, ep=4)
    experts = MIXTRAL.expert_params()
    dense, expert = 2 * (MIXTRAL.num_params("lm") - experts), 2 * experts / 4  # bf16 shards at tp = pp = 1
    steps = W.ppo_epochs * W.mini_batches
    dp_bytes = steps * 3 * (7 / 8 * dense + 1 / 2 * expert)  # fp32 gradients + bf16 weights; 2 ranks per expert
    tr, fw = cm().train(MIXTRAL, "lm", par, W), cm().forward(MIXTRAL, "lm", par, W)
    base = cm().train(MIXTRAL, "lm", meg(dp=8), W)  # its dp traffic: the whole model over 8 ranks
    dispatch = tr.breakdown["ep_comm"] * NVLINK  # all of it on NVLink
    assert tr.bytes - base.bytes == pytest.approx(dispatch + dp_bytes - steps * 3 * 7 / 8 * (dense + 2 * experts))
    assert tr.breakdown["dp_comm"] == pytest.approx(steps * (3 * (7 / 8 * dense + 1 / 2 * expert) / NVLINK
                                                             + 4 * A100.intra_node_latency))
    assert fw.breakdown.get("dp_comm", 0.0) == 0.0
    # less dp traffic than at ep = 1: each rank's experts are an ep-th of them
    assert tr.breakdown["dp_comm"] < base.breakdown["dp_comm"]


def test_ep_one_and_dense_models_price_no_dispatch():
    llama = model_preset("llama2-7b")
    for model, par in ((MIXTRAL, meg(tp=2, dp=4)), (MIXTRAL, ParallelConfig(tp=2, dp=4)), (llama, meg(tp=2, dp=4))):
        f = cm().forward(model, "lm", par, W)
        assert "ep_comm" not in f.breakdown
        # the collectives' latencies are the tensor-parallel all-reduces' alone: 2 per layer per micro-batch
        micro = -(-W.sequences // 4) // W.micro_batch_size
        assert f.breakdown["latency"] == pytest.approx(micro * 2 * model.layers * A100.intra_node_latency)
        assert f.breakdown["tp_comm"] == pytest.approx(micro * 2 * model.layers * 2 * W.micro_batch_size
                                                       * W.seq_len * model.hidden / NVLINK)


def test_dispatch_across_nodes_takes_the_network():
    par = meg(tp=4, dp=4, ep=4)  # ep ranks 0, 4, 8, 12: two nodes of 8
    inter = A100.inter_node_bandwidth * P.inter_link_efficiency / 4  # 4 of the config's rings per NIC
    b, micro = W.micro_batch_size, (W.sequences // 4) // W.micro_batch_size
    one = 3 / 4 * 2 * b * W.seq_len * 2 * MIXTRAL.hidden
    f = cm(nodes=2).forward(MIXTRAL, "lm", par, W)
    assert f.breakdown["ep_comm"] == pytest.approx(micro * 2 * MIXTRAL.layers * one / inter)


def test_megatron_gradient_buffer_splits_the_experts_over_ep():
    experts, params = MIXTRAL.expert_params(), MIXTRAL.num_params("lm")
    for ep in (1, 4):
        g = state_bytes(MIXTRAL, "lm", meg(tp=2, dp=4, ep=ep), True).gradients  # resident (memory.state_bytes)
        assert g == pytest.approx(4 * ((params - experts) + experts / ep) / 2)  # fp32, over tp


def test_switch_to_generation_gathers_the_other_ep_ranks_experts():
    train, gen = meg(tp=2, dp=4, ep=4), ParallelConfig(tp=2, dp=4)
    base = cm().reshard(MIXTRAL, meg(tp=2, dp=4), gen, "hybridflow")
    r = cm().reshard(MIXTRAL, train, gen, "hybridflow")
    size = 2 * MIXTRAL.expert_params() / 2  # bf16 experts over tp, as the memory model splits them
    assert r.bytes - base.bytes == pytest.approx(3 / 4 * size)
    assert r.breakdown["ep_gather"] == pytest.approx(3 / 4 * size / NVLINK)  # ep ranks 0, 2, 4, 6: one node
    gathers = MIXTRAL.layers * (8 // 4) * 3  # one per local expert's gate, up and down per layer
    assert r.seconds - base.seconds == pytest.approx(3 / 4 * size / NVLINK + gathers * A100.intra_node_latency)
    assert "ep_gather" not in base.breakdown
