"""A batch's rollout made as calls one after another (simulator/pricing/rollout_calls.py)."""

import pytest
from pricing_toys import HW, TOY, cluster

from hybridflow.simulator import ParallelConfig, Workload
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.rollout_calls import StreamedRollout, call_shares, sequential_generate
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.plan import stream_calls

GEN = ParallelConfig(dp=2)
TAIL = LengthDistribution.max_entropy(64, 512, shortest=8)


def _workload(lengths=None) -> Workload:
    return Workload(prompts=8, samples_per_prompt=4, prompt_len=16, response_len=512, response_lengths=lengths)


def test_the_batch_s_lengths_are_dealt_to_the_calls_from_the_longest_down():
    w = _workload(TAIL)
    batch = sorted(TAIL.sample(32), reverse=True)
    shares = call_shares(w, 32, 2)
    assert [n for _, n in shares] == [16, 16]
    dealt = [sorted(s.response_lengths.sample(n), reverse=True) for s, n in shares]
    assert dealt == [batch[0::2], batch[1::2]]  # each call draws exactly its own lengths
    assert max(dealt[0]) == 512 and max(dealt[1]) < 512  # one call meets the longest, the other its runner-up
    assert all(s.response_len == 512 for s, _ in shares)  # memory still sized for the longest allowed


def test_calls_in_turn_cost_their_prices_added_and_more_than_one_call():
    cm = CostModel(cluster(hw=HW))
    w = _workload(TAIL)
    two = sequential_generate(cm, TOY, GEN, w, 32, 2)
    by_hand = sum(cm.generate(TOY, GEN, s, n).seconds for s, n in call_shares(w, 32, 2))
    assert two.seconds == pytest.approx(by_hand, rel=1e-12)
    assert two.seconds > cm.generate(TOY, GEN, w, 32).seconds  # each call decodes half the batch, to its own tail
    fixed = _workload()
    assert sequential_generate(cm, TOY, GEN, fixed, 32, 2).seconds == pytest.approx(
        2 * cm.generate(TOY, GEN, fixed, 16).seconds, rel=1e-12)
    assert sequential_generate(cm, TOY, GEN, w, 32, 1).seconds == cm.generate(TOY, GEN, w, 32).seconds


def test_the_async_mode_s_calls_wait_the_controller_s_gap_between_queued_calls():
    gap = 0.004
    cm = ProfiledCostModel(cluster(hw=HW), overheads=EngineOverheads(queued_call_seconds=gap))
    w = _workload(TAIL)
    streamed = StreamedRollout(cm).generate(TOY, GEN, w)
    assert stream_calls(w.prompts) == 2
    assert streamed.breakdown["dispatch"] == pytest.approx(gap)
    assert streamed.seconds == pytest.approx(sequential_generate(cm, TOY, GEN, w, 32, 2).seconds + gap, rel=1e-12)
    assert StreamedRollout(cm).forward == cm.forward  # every other price is the wrapped model's
