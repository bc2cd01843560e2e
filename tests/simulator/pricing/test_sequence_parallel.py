"""Sequence parallelism priced: Ulysses' all-to-all volumes over the sequence's ranks, Megatron's context
parallelism (ring attention) as K,V chunks passed round the ring under the attention, activations per
device divided by sp, the same compute spread over the devices; the layout's rules."""

import pytest
from pydantic import ValidationError

from hybridflow.simulator import ClusterSpec, ModelSpec, ParallelConfig, Workload
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.comm import sp_ranks
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.memory import forward_transient, train_transient
from hybridflow.simulator.vocabulary.hardware import hardware_preset
from hybridflow.simulator.vocabulary.units import BF16

MODEL = ModelSpec(name="m", layers=4, hidden=1024, heads=8, kv_heads=4, ffn=2816, vocab=8000)
CLUSTER = ClusterSpec(hardware=hardware_preset("h100-80g"), nodes=1, devices_per_node=8)
LONG = Workload(prompts=16, prompt_len=1024, response_len=7168, micro_batch_size=1, mini_batches=1)


def test_each_device_holds_a_sp_th_of_its_sequences_activations():
    one, two = ParallelConfig(dp=8), ParallelConfig(dp=8, sp=2)
    assert train_transient(MODEL, "lm", two, LONG).activations == pytest.approx(
        train_transient(MODEL, "lm", one, LONG).activations / 2)
    assert forward_transient(MODEL, "lm", two, LONG).activations == pytest.approx(
        forward_transient(MODEL, "lm", one, LONG).activations / 2)


def test_the_all_to_alls_are_priced_on_the_sequence_ranks():
    cm = CostModel(CLUSTER)
    par = ParallelConfig(dp=8, sp=4)
    assert sp_ranks(par) == (0, 1, 2, 3)
    cost = cm.forward(MODEL, "lm", par, LONG)
    # 16 sequences over dp/sp = 2 groups: 8 micro-batches of one sequence, each device 8192/4 tokens of it;
    # 2 all-to-alls per layer per micro-batch of (hidden + kv width) tokens' worth on average
    per = BF16 * (8192 / 4) * (1024 + 4 * 128)
    bw, lat = cm.alltoall(per, 8, (0, 1, 2, 3))
    assert cost.breakdown["sp_comm"] == pytest.approx(2 * 4 * 8 * bw)
    # the work is the same, spread over the same devices: compute as without sp, up to the smaller matmuls
    plain = cm.forward(MODEL, "lm", ParallelConfig(dp=8), LONG)
    assert plain.breakdown["compute"] <= cost.breakdown["compute"] < 1.2 * plain.breakdown["compute"]
    assert cost.flops == plain.flops


@pytest.mark.parametrize("kw,msg", [({"dp": 6, "sp": 4}, "must divide dp"),
                                    ({"dp": 4, "sp": 2, "backend": "deepspeed"}, "fsdp \\(Ulysses\\) and megatron")])
def test_bad_layouts_are_refused(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        ParallelConfig(**kw)


def test_sp_times_tp_must_give_each_rank_whole_heads():
    with pytest.raises(HflowError, match="sp·tp=16 must divide heads=8"):
        ParallelConfig(tp=2, dp=8, sp=8).validate_for(MODEL)
    ParallelConfig(tp=2, dp=4, sp=4).validate_for(MODEL)
    assert ParallelConfig(dp=8, sp=2).generation_layout() == ParallelConfig(dp=8)
    assert ParallelConfig(dp=8, sp=2).label() == "1-1-8-sp2"


def test_context_parallelism_passes_kv_chunks_round_the_ring_under_the_attention():
    par = ParallelConfig(dp=8, sp=8, backend="megatron")  # no head rule: ring attention splits tokens, not heads
    par.validate_for(MODEL)
    # each device 8192/8 tokens of its micro-batch's sequence: its K and V chunk, sent sp-1 = 7 times per layer
    chunk = BF16 * 2 * (8192 / 8) * 4 * 128
    sends = 7 * 4 * 16  # (sp-1) · layers · micro-batches (16 sequences, one group of 8 ranks, one per micro-batch)
    pm, attn = MODEL.matmul_params("lm"), 4.0 * 4 * 8 * 128
    for cluster in (CLUSTER, ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=2, devices_per_node=4)):
        cm = CostModel(cluster)
        link = cm.link(8, sp_ranks(par))  # across the two nodes the ring's slow hop (a 25 GB/s NIC) paces it
        fwd, upd = cm.forward(MODEL, "lm", par, LONG), cm.train(MODEL, "lm", par, LONG)
        assert fwd.breakdown["latency"] == pytest.approx(sends * link.latency)
        assert upd.breakdown["latency"] == pytest.approx(3 * sends * link.latency)  # K,V again and their gradients
        # hidden under the attention (its share of the compute); only the rest is exposed
        work = 8192 * (2.0 * pm + attn * 8193 / 2.0 / cm.params.attention_efficiency)
        share = 1.0 - 2.0 * pm * 8192 / work
        exposed = sends * chunk / link.bandwidth - share * fwd.breakdown["compute"]
        assert fwd.breakdown.get("sp_comm", 0.0) == pytest.approx(max(0.0, exposed))
    assert link.crosses_nodes and exposed > 0  # over the network the attention no longer hides it


def test_context_parallelism_is_refused_by_the_runtime_in_one_line():
    from hybridflow.simulator.vocabulary.execution import context_parallel_problem

    line = context_parallel_problem(ParallelConfig(dp=8, sp=2, backend="megatron"))
    assert line is not None and "\n" not in line and "backend fsdp (Ulysses sp)" in line
    assert context_parallel_problem(ParallelConfig(dp=8, sp=2)) is None
