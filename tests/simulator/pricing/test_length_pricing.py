"""Pricing a distribution of response lengths: the decode schedule by hand, its closed-form price equal to
the step-by-step sum, fixed lengths unchanged, packed training."""

import pytest

from hybridflow.simulator import ClusterSpec, ModelSpec, ParallelConfig, Workload
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.decode_schedule import Segment, replica_decode, slowest_replica_lengths
from hybridflow.simulator.pricing.op_cost import model_shape, seq_flops
from hybridflow.simulator.pricing.sequence_batches import micro_batches
from hybridflow.simulator.vocabulary.hardware import hardware_preset
from hybridflow.simulator.vocabulary.lengths import LengthDistribution

MODEL = ModelSpec(name="m", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=2816, vocab=8000)
CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
TAIL = {"quantiles": {0.0: 20, 0.5: 100, 0.9: 300, 1.0: 1000}}


def test_continuous_batching_refills_slots_as_sequences_finish():
    d = replica_decode((3, 5, 2), 2, True)
    # t=0: 3 and 5 join; at t=2 the 3 ends and the 2 joins (holding 1 token); at t=3 it ends; the 5 ends at t=4
    assert d.segments == (Segment(2, 2, 2), Segment(1, 2, 4), Segment(1, 1, 4))
    assert (d.admissions, d.sequences, d.tokens) == (2, 3, 10)


def test_static_batches_run_until_their_longest_ends():
    d = replica_decode((3, 5, 2), 2, False)
    assert d.segments == (Segment(4, 2, 2), Segment(1, 1, 1)) and d.admissions == 2


def test_the_slowest_replica_is_dealt_the_top_of_every_block():
    dist = LengthDistribution(**TAIL)
    ordered = dist.sample(8)
    assert sorted(slowest_replica_lengths(dist, 8, 2)) == sorted(ordered[1::2])


def _stepwise(cm, gen, w, free):
    """The same generation priced one decode step at a time (decode_step at the batch's mean context)."""
    d = generation.slowest_replica(cm, MODEL, gen, w, w.sequences, free)
    pre = generation.prefill(cm, MODEL, gen, -(-d.sequences // d.admissions), w.prompt_len)
    total = d.admissions * sum(pre.values())
    for seg in d.segments:
        for j in range(seg.steps):
            context = w.prompt_len + (seg.generated + seg.batch * j) / seg.batch
            total += generation.decode_step(cm, MODEL, gen, seg.batch, context)["step_seconds"]
    return total


@pytest.mark.parametrize("free_gib", [0.05, 0.3, 20.0])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_closed_form_equals_the_step_by_step_sum(free_gib, tp):
    cm = CostModel(CLUSTER)
    gen = ParallelConfig(tp=tp, dp=8 // tp)
    w = Workload(prompts=64, prompt_len=128, samples_per_prompt=2, response_lengths=TAIL)
    got = cm.generate(MODEL, gen, w, free_bytes_per_device=free_gib * 2**30).seconds
    assert got == pytest.approx(_stepwise(cm, gen, w, free_gib * 2**30), rel=1e-9)


def test_a_one_point_distribution_prices_as_fixed_lengths():
    cm = CostModel(CLUSTER)
    gen = ParallelConfig(tp=2, dp=4)
    fixed = Workload(prompts=64, prompt_len=128, response_len=512)
    one = fixed.model_copy(update={"response_lengths": LengthDistribution.fixed(512)})
    for op in (lambda w: cm.generate(MODEL, gen, w), lambda w: cm.forward(MODEL, "lm", ParallelConfig(dp=8), w),
               lambda w: cm.train(MODEL, "lm", ParallelConfig(dp=8), w)):
        assert op(one).seconds == pytest.approx(op(fixed).seconds, rel=1e-12)


def test_the_tail_costs_more_than_the_mean_and_less_than_the_longest():
    cm = CostModel(CLUSTER)
    gen = ParallelConfig(tp=1, dp=8)
    tail = Workload(prompts=256, prompt_len=128, samples_per_prompt=4, response_lengths=TAIL)
    mean = Workload(prompts=256, prompt_len=128, samples_per_prompt=4, response_len=round(tail.mean_response_len))
    longest = mean.model_copy(update={"response_len": 1000})
    t, m, lo = (cm.generate(MODEL, gen, w).seconds for w in (tail, mean, longest))
    assert m < t < lo
    # a static engine waits for each batch's longest response: slower than continuous batching on a tail
    assert cm.generate(MODEL, gen, tail, batch_cap=16).seconds > cm.generate(MODEL, gen, tail).seconds


def test_packed_training_counts_real_tokens_and_per_sequence_attention():
    w = Workload(prompts=64, prompt_len=128, micro_batch_size=4, response_lengths=TAIL)
    _, pm, attn, _ = model_shape(MODEL, "lm")
    lengths = LengthDistribution(**TAIL).sample(w.sequences)  # the batch's lengths, as its rollout draws them
    by_sample = sum(seq_flops(pm, attn, 128 + n) for n in lengths) / len(lengths)
    cm = CostModel(CLUSTER)
    flops = cm.forward(MODEL, "lm", ParallelConfig(dp=8), w).flops / w.sequences
    assert flops == pytest.approx(by_sample, rel=2e-3)
    per_rank, m, rows = micro_batches(w, w.sequences, 1, 8)
    assert per_rank == 8 and rows <= 4 * w.seq_len and m == 1  # 8 sequences of ~340 tokens in one 4×1128 budget
    padded = w.model_copy(update={"response_lengths": None, "response_len": 1000})
    assert cm.forward(MODEL, "lm", ParallelConfig(dp=8), w).seconds < cm.forward(MODEL, "lm", ParallelConfig(dp=8),
                                                                                padded).seconds
