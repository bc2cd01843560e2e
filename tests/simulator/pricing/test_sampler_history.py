"""vLLM 0.3/0.4's sampler rebuilds every sequence's token history (prompt + tokens so far) into padded tensors
each step (efficiency.EfficiencyParams.sampler_history_seconds), the GPU idle meanwhile: priced per token of the
histories the slowest replica holds at each pass, on hand-computed values, for fixed lengths and a distribution."""

import pytest
from pricing_toys import TOY, cluster

from hybridflow.simulator import ParallelConfig, Workload
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import HISTORY_TOKEN_SECONDS, EfficiencyParams, engine_params
from hybridflow.simulator.vocabulary.lengths import LengthDistribution

CLUSTER = cluster()
S = 1e-3  # seconds per history token: round, so the figures below are token counts in ms


def cost(gen: ParallelConfig, w: Workload, history: float = S, **params):
    cm = CostModel(CLUSTER, EfficiencyParams(sampler_history_seconds=history, **params))
    return cm.generate(TOY, gen, w)


@pytest.mark.parametrize(("engine", "version", "history"), [
    ("vllm", "0.3.1", HISTORY_TOKEN_SECONDS), ("vllm", "0.4.2", HISTORY_TOKEN_SECONDS), ("vllm", "0.2.6", 0.0),
    ("vllm", "0.5.4", 0.0), ("vllm", "0.6.0", 0.0), ("vllm", None, 0.0), ("tensorrt-llm", "0.5.0", 0.0)])
def test_engine_params_set_the_history_copy_for_vllm_0_3_and_0_4_only(engine, version, history):
    assert EfficiencyParams(**engine_params(engine, version)).sampler_history_seconds == history


def test_fixed_lengths_every_pass_rebuilds_each_sequences_prompt_and_output_so_far():
    # 10 prompts of 8 tokens, 16-token responses, on 2 replicas: 5 sequences each (waves of 2, 2, 1). Each
    # sequence: its prefill samples with 8 tokens of history, its 15 decode steps with 8 + 1 … 8 + 15:
    # 16·8 + 15·16/2 = 248 tokens, 5·248 = 1240 on the slowest replica
    w, gen = Workload(prompts=10, prompt_len=8, response_len=16), ParallelConfig(dp=2)
    with_it, without = cost(gen, w, max_decode_batch=2), cost(gen, w, history=0.0, max_decode_batch=2)
    assert with_it.breakdown["host"] == pytest.approx(1240 * S)
    assert "host" not in without.breakdown  # nothing rebuilt, no part
    assert with_it.seconds - without.seconds == pytest.approx(1240 * S)  # the GPU's parts untouched


def test_the_history_is_a_replicas_whole_batch_whatever_its_tensor_parallelism():
    # 10 sequences on one tp=2 replica rebuild twice the histories of 5 on each of two tp=1 replicas
    w = Workload(prompts=10, prompt_len=8, response_len=16)
    assert cost(ParallelConfig(tp=2), w).breakdown["host"] == pytest.approx(10 * 248 * S)
    assert cost(ParallelConfig(dp=2), w).breakdown["host"] == pytest.approx(5 * 248 * S)
    assert cost(ParallelConfig(tp=2, dp=2), w).breakdown["host"] == pytest.approx(5 * 248 * S)


def test_a_length_distribution_counts_each_sequence_until_it_ends():
    # one replica, responses of 2 and 4 tokens decoded together: the 2-token one samples at 8 (prefill) and
    # 9; the 4-token one at 8, 9, 10, 11: 17 + 38 = 55 tokens
    dist = LengthDistribution(quantiles={0.5: 2, 1.0: 4})
    assert list(dist.sample(2)) == [2, 4]
    w = Workload(prompts=2, prompt_len=8, response_lengths=dist)
    assert cost(ParallelConfig(), w).breakdown["host"] == pytest.approx(55 * S)


def test_a_fixed_distribution_prices_as_fixed_lengths():
    fixed = Workload(prompts=10, prompt_len=8, response_len=16)
    dist = fixed.model_copy(update={"response_lengths": LengthDistribution.fixed(16)})
    for gen in (ParallelConfig(dp=2), ParallelConfig(tp=2)):
        assert cost(gen, dist, max_decode_batch=2).breakdown["host"] == pytest.approx(
            cost(gen, fixed, max_decode_batch=2).breakdown["host"])


def test_pass_by_pass_sum_matches_the_closed_form():
    # 3 sequences on one replica, 7-token responses: the history summed pass by pass, as the engine rebuilds it
    w, gen = Workload(prompts=3, prompt_len=5, response_len=7), ParallelConfig()
    per_pass = [3 * (5 + k) for k in range(7)]  # the prefill (k = 0) and six decode steps
    assert cost(gen, w).breakdown["host"] == pytest.approx(sum(per_pass) * S)
    assert generation.decode_counts(CostModel(CLUSTER), TOY, gen, w, 3, None) == (7, 21)
