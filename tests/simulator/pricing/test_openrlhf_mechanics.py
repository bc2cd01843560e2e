"""OpenRLHF v0.2's mechanics where responses differ in length, each on hand-computed values: a vLLM call's finished
sequences leaving its batch (`drain_calls`), rows padded to their own batch's longest (`rows_padded_per_batch`),
the expected longest of n responses, HF generate's loop run to each batch's longest, and FlashAttention-2's
copies of the KV cache."""

import pytest
from rl_util import tiny_plan

from hybridflow.simulator import ClusterSpec, ModelSpec, ParallelConfig, Plan, Workload
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.baseline_mechanics import (
    eager_decode_step,
    eager_generate_extra,
    hf_generate_slowdown,
)
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.decode_schedule import Segment, replica_decode
from hybridflow.simulator.pricing.generation import decode_step
from hybridflow.simulator.pricing.plan_memory import kv_free_bytes
from hybridflow.simulator.vocabulary.hardware import hardware_preset
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.model import model_preset
from hybridflow.simulator.vocabulary.roles import role_head

CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
MODEL = ModelSpec(name="m", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=2816, vocab=8000)
UNIFORM = {"quantiles": {0.0: 1, 1.0: 1001}}  # every length from 1 to 1001 alike


def test_a_drained_call_lets_finished_sequences_leave_and_waits_for_its_longest():
    # calls of 2: (3, 5) then (2). Kept rows: 4 steps at 2 rows, then 1 step at 1 row
    assert replica_decode((3, 5, 2), 2, False).segments == (Segment(4, 2, 2), Segment(1, 1, 1))
    # drained: the 3 leaves after its 2 steps, the 5 decodes its last 2 alone (holding 3 tokens); no refill from
    # the next call, which starts when the 5 ends
    d = replica_decode((3, 5, 2), 2, False, drain=True)
    assert d.segments == (Segment(2, 2, 2), Segment(2, 1, 3), Segment(1, 1, 1))
    assert (d.admissions, d.sequences, d.tokens) == (2, 3, 10)


def test_expected_longest_of_n_responses():
    uniform = LengthDistribution(**UNIFORM)
    for n in (1, 2, 4, 16):  # uniform on [1, 1001]: E[max of n] = 1 + 1000·n/(n + 1)
        assert uniform.expected_longest(n) == pytest.approx(1 + 1000 * n / (n + 1))
    # half the responses 1 token, the rest 1 to 101: ∫ q(u)·2u du = 0.25 + 0.75 + 200·(1/6 + 1/24) = 42.667
    assert LengthDistribution(quantiles={0.0: 1, 0.5: 1, 1.0: 101}).expected_longest(2) == pytest.approx(42.6667, abs=1e-3)
    assert LengthDistribution.fixed(300).expected_longest(8) == pytest.approx(300)
    # a workload padded per batch of 4: every response 1 + 1000·4/5 = 801 tokens; fixed lengths stay as they are
    padded = Workload(prompts=4, response_lengths=UNIFORM).padded_per_batch(4)
    assert (padded.response_len, padded.response_lengths) == (801, None)
    fixed = Workload(prompts=4, response_len=300)
    assert fixed.padded_per_batch(8) is fixed


def test_drained_calls_price_as_the_step_by_step_sum():
    cm = CostModel(CLUSTER)
    gen = ParallelConfig(tp=1, dp=2)
    w = Workload(prompts=16, prompt_len=64, response_lengths=UNIFORM)
    d = generation.slowest_replica(cm, MODEL, gen, w, 16, None, batch_cap=4, drain_calls=True)
    assert d.admissions == 2 and all(s.batch <= 4 for s in d.segments)
    pre = generation.prefill(cm, MODEL, gen, 4, w.prompt_len)
    want = d.admissions * sum(pre.values())
    for seg in d.segments:
        for j in range(seg.steps):
            want += decode_step(cm, MODEL, gen, seg.batch, w.prompt_len + (seg.generated + seg.batch * j) / seg.batch
                                )["step_seconds"]
    drained = cm.generate(MODEL, gen, w, 16, None, batch_cap=4, drain_calls=True)
    assert drained.seconds == pytest.approx(want, rel=1e-9)
    # rows leaving can only save work: cheaper than the same calls with their finished rows kept
    kept = cm.generate(MODEL, gen, w, 16, None, batch_cap=4)
    assert drained.seconds < kept.seconds


def _openrlhf_plan(mechanics: Mechanics) -> Plan:
    w = Workload(prompts=16, prompt_len=16, response_lengths={"quantiles": {0.0: 1, 1.0: 65}}, micro_batch_size=2,
                 mini_batches=2)
    plan = tiny_plan("ppo", devices=[2, 1], train={"actor": ParallelConfig(tp=2), "ref": ParallelConfig(tp=2)},
                     generate=ParallelConfig(dp=2), workload=w)
    return Plan.model_validate({**plan.model_dump(), "mechanics": mechanics.model_dump()})


def test_rows_padded_per_batch_price_scoring_and_training_at_their_batch_s_expected_longest():
    cm = CostModel(CLUSTER)
    padded = _openrlhf_plan(Mechanics(system="openrlhf", batching="static", generation_batch=4,
                                      rows_padded_per_batch=True))
    w = padded.workload
    # uniform on [1, 65]: a call of 4 is 1 + 64·4/5 = 52.2 → 52 tokens wide, a micro-batch of 2 1 + 64·2/3 → 44
    assert round(w.response_lengths.expected_longest(4)) == 52 and round(w.response_lengths.expected_longest(2)) == 44
    ref = padded.roles["ref"]
    at_call = w.model_copy(update={"response_lengths": None, "response_len": 52})
    assert price_op(cm, padded, "ref_logprob", "ref").seconds == pytest.approx(
        cm.forward(ref.model, role_head("ref"), ref.train, at_call, w.sequences, micro_batch_tokens=None).seconds)
    actor = padded.roles["actor"]
    at_micro = w.model_copy(update={"response_lengths": None, "response_len": 44})
    assert price_op(cm, padded, "actor_update", "actor").seconds == pytest.approx(
        cm.train(actor.model, role_head("actor"), actor.train, at_micro, micro_batch_tokens=None).seconds)
    # without the mechanic the rows are sorted into buckets (the runtime's bucket_order): narrower, cheaper
    sorted_rows = _openrlhf_plan(Mechanics(system="openrlhf", batching="static", generation_batch=4))
    assert price_op(cm, sorted_rows, "ref_logprob", "ref").seconds < price_op(cm, padded, "ref_logprob", "ref").seconds


def test_flash_attention_2_copies_the_cache_six_times_a_step():
    cm = CostModel(CLUSTER)
    m7, gen = model_preset("llama2-7b"), ParallelConfig(tp=1, dp=8)
    kv = 8 * 1000 * m7.kv_bytes_per_token()  # 8 sequences at 1000 tokens
    # torch.cat (read + write), the reshape of the transposed view (read + write), the unpadding gather (read + write)
    assert eager_decode_step(cm, m7, gen, 8, 1000.0, "hf-eager-fa2")["kv_copy"] == pytest.approx(6 * kv / cm.hbm)
    assert eager_decode_step(cm, m7, gen, 8, 1000.0, "hf-eager")["kv_copy"] == pytest.approx(2 * kv / cm.hbm)


def test_hf_generate_runs_each_batch_until_its_longest_response():
    cm = CostModel(CLUSTER)
    plan = _openrlhf_plan(Mechanics(system="openrlhf", batching="static", generation_batch=4))
    w, gen, model = plan.workload, plan.generation_config(), plan.roles["actor"].model
    base = price_op(cm, plan, "generate", "actor").seconds
    _, waves, batch = generation.decode_waves(cm, model, gen, w, w.sequences, kv_free_bytes(plan, cm.params), 4)
    assert (waves, batch) == (2, 4)  # 8 sequences per replica, 2 calls of 4
    longest = w.model_copy(update={"response_lengths": None, "response_len": 52})  # E[longest of 4]: 52 tokens
    extra = eager_generate_extra(cm, model, gen, longest, waves, batch, "hf-eager-fa2")
    assert hf_generate_slowdown(cm, plan, "hf-eager-fa2") == pytest.approx(1 + extra / base)
