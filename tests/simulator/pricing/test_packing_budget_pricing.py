"""The plan's token budget is what the simulator prices (issue 34): a packed role at its own micro_batch_tokens,
a role without one as the engine runs it then (rows padded to their length bucket's longest)."""

import pytest

from hybridflow.simulator import ClusterSpec, ModelSpec, ParallelConfig, Workload
from hybridflow.simulator.calibration.fit import calibrate_file
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.op_cost import model_shape, seq_flops
from hybridflow.simulator.pricing.sequence_batches import micro_batches, padded_widths
from hybridflow.simulator.vocabulary.hardware import hardware_preset
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.plan import Plan, default_micro_batch_tokens

MODEL = ModelSpec(name="m", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=2816, vocab=8000)
CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
LINE = {"quantiles": {0.0: 10, 1.0: 100}}  # uniform lengths 10..100: quantile(u) = 10 + 90·u


def _workload(**over) -> Workload:
    return Workload(**{"prompts": 64, "prompt_len": 20, "micro_batch_size": 4, "response_lengths": LINE, **over})


def test_padded_micro_batches_are_as_wide_as_their_bucket_s_longest_row():
    w = _workload()
    # 8 rows of a rank in buckets of 4: the 4th row sits at share 3.5/8, the last is the batch's longest
    assert padded_widths(w, 8, 4) == [(4, 20 + 10 + 90 * 3.5 / 8), (4, 20 + 100)]
    assert padded_widths(w, 6, 4) == [(4, 20 + 10 + 90 * 3.5 / 6), (2, 120)]
    per_rank, m, rows = micro_batches(w, 64, 1, 8, None)
    assert (per_rank, m, rows) == (8, 2, pytest.approx((4 * 69.375 + 4 * 120) / 2))
    _, pm, attn, _ = model_shape(MODEL, "lm")
    padded = CostModel(CLUSTER).forward(MODEL, "lm", ParallelConfig(dp=8), w, micro_batch_tokens=None)
    assert padded.flops / w.sequences == pytest.approx((4 * seq_flops(pm, attn, 69.375) + 4 * seq_flops(pm, attn, 120)) / 8)


def test_a_token_budget_sets_the_packed_micro_batches():
    w = _workload()
    rank_tokens = 8 * (20 + 55)
    assert micro_batches(w, 64, 1, 8, 200) == (8, 3, pytest.approx(rank_tokens / 3))
    assert micro_batches(w, 64, 1, 8, 1000) == (8, 1, pytest.approx(rank_tokens))
    # no budget named: the planner's (micro_batch_size · seq_len), what default_micro_batch_tokens puts in a plan
    assert micro_batches(w, 64, 1, 8) == micro_batches(w, 64, 1, 8, default_micro_batch_tokens(w, ParallelConfig()))


CAL = calibrate_file("cpu-2core")  # the engines' fixed cost per micro-batch counts on a CPU profile


def _plan(budget) -> Plan:
    role = {"model": "tiny", "group": "all", "train": {"dp": 2}}
    roles = {"actor": dict(role), "ref": dict(role)}
    if budget is not None:
        roles["actor"]["micro_batch_tokens"] = budget
        roles["ref"]["micro_batch_tokens"] = budget
    return Plan.model_validate({
        "algorithm": "grpo", "reward_function": "hybridflow.runtime.tasks.builtin:sort_reward", "cluster": CAL.cluster(nodes=1, devices_per_node=2).model_dump(),
        "workload": {"prompts": 16, "samples_per_prompt": 4, "prompt_len": 48, "micro_batch_size": 8,
                     "response_lengths": LengthDistribution.max_entropy(128, 1024).model_dump()},
        "groups": [{"name": "all", "devices": [{"node": 0, "index": 0}, {"node": 0, "index": 1}]}],
        "roles": roles})


@pytest.mark.parametrize("op,role", [("ref_logprob", "ref"), ("actor_update", "actor")])
def test_price_op_prices_the_plan_s_own_budget(op, role):
    cm = CAL.cost_model(CAL.cluster(nodes=1, devices_per_node=2))
    default = default_micro_batch_tokens(_plan(None).workload, ParallelConfig(dp=2))
    price = {b: price_op(cm, _plan(b), op, role).seconds for b in (None, default, default // 8)}
    # a budget of an eighth: more, smaller micro-batches, each paying its passes' fixed cost
    assert price[default // 8] > price[default] * 1.02
    # no budget: the engine runs padded rows; the long tail's padding costs far more than packing
    assert price[None] > 2 * price[default]
    model, par, w = _plan(None).roles[role].model, ParallelConfig(dp=2), _plan(None).workload
    priced = cm.train(model, "lm", par, w) if op == "actor_update" else cm.forward(model, "lm", par, w)
    assert price[default] == pytest.approx(priced.seconds, rel=1e-12)  # the planner's default is the plan's


def test_the_memory_model_holds_a_packed_micro_batch_of_the_budget_at_most_the_rank_s_step():
    from hybridflow.simulator.pricing.plan_memory import plan_memory

    w = _plan(None).workload
    small = {b: plan_memory(_plan(b))["actor"].own.activations for b in (1072, 1608)}
    assert small[1608] == pytest.approx(1.5 * small[1072], rel=1e-12)  # activations and logits per token
    # the batch's representative lengths dealt over dp 2 in equal counts: the most loaded rank holds the mean
    # share (32 rows); its rows cut into 4 mini-batches of 8, the one holding the longest (48 + 1024) filled
    # with average rows — below the planner's budget of 8 · 1072
    assert (w.sequences, w.mini_batches) == (64, 4)
    lengths = [48 + r for r in w.response_lengths.sample(64)]
    share = sum(lengths) / 2
    held = 1072 + (share - 1072) * 7 / 31
    default = default_micro_batch_tokens(w, ParallelConfig(dp=2))
    assert default == 8 * 1072 > held
    for budget in (default, 2 * default):
        assert plan_memory(_plan(budget))["actor"].own.activations == pytest.approx(small[1072] / 1072 * held, rel=1e-12)


@pytest.mark.parametrize("dp", [2, 4, 8, 16])
@pytest.mark.parametrize("mean,longest", [(128, 1024), (2048, 16384), (500, 600)])
def test_the_priced_rank_load_is_the_runtime_s_balanced_partition(dp, mean, longest):
    from hybridflow.runtime.controller.protocols import balanced_partition
    from hybridflow.simulator.pricing.activations import micro_batch_tokens_held

    w = Workload(prompts=64, prompt_len=100, micro_batch_size=4, mini_batches=1,
                 response_lengths=LengthDistribution.max_entropy(mean, longest))
    lengths = [100 + r for r in w.response_lengths.sample(64)]
    heaviest = max(sum(lengths[i] for i in part) for part in balanced_partition(lengths, dp))
    priced = micro_batch_tokens_held(w, dp, 1, 10**9)
    # the optimum's lower bound: the partition lies at most a few % above it where a rank holds few rows
    assert heaviest * 0.95 <= priced <= heaviest


def test_packed_passes_compute_every_sample_s_prompt():
    # the engine computes a prompt once for its samples only on padded rows (prompt sharing is off while packing)
    w = Workload(prompts=16, samples_per_prompt=4, prompt_len=64, response_len=64, micro_batch_size=4)
    _, pm, attn, _ = model_shape(MODEL, "lm")
    cm, par = CostModel(CLUSTER), ParallelConfig(dp=8)
    rows = cm.forward(MODEL, "lm", par, w, micro_batch_tokens=None).flops / w.sequences
    packed = cm.forward(MODEL, "lm", par, w, micro_batch_tokens=4 * 128).flops / w.sequences
    assert packed == pytest.approx(seq_flops(pm, attn, 128), rel=1e-12)
    assert rows == pytest.approx(seq_flops(pm, attn, 128) - 0.75 * seq_flops(pm, attn, 64), rel=1e-12)
