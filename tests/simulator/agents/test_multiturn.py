"""The multi-turn rollout price (simulator/agents/multiturn.py) against hand computations of the runner's
policy: lockstep waits for every tool before the next turn, overlap decodes a conversation as soon as
its tool returns, a prefix cache re-prefills only the new tokens."""

from __future__ import annotations

import pytest

from hybridflow.simulator.agents.multiturn import (
    DecodeCost,
    MultiTurnWorkload,
    price_rollout,
    simulate_rollout,
)

COST = DecodeCost(fixed=0.1, per_step=0.01, per_row_step=0.0, per_prefill_token=0.001)


def workload(**kw) -> MultiTurnWorkload:
    base = dict(conversations=2, prompt_tokens=20, turns=[2], turn_tokens=[10], tool_turn_tokens=[5],
                tool_seconds=[1.0], tool_workers=2, overlap=False)
    return MultiTurnWorkload(**(base | kw))


def test_lockstep_by_hand():
    # decode 1: 0.1 + 10·0.01 + 40·0.001 = 0.24; tools 1.0 in parallel; decode 2: 0.2 + 2·35·0.001 = 0.27
    assert simulate_rollout(workload(), COST) == pytest.approx(0.24 + 1.0 + 0.27)


def test_overlap_with_one_tool_worker_by_hand():
    # tools run one after the other (0.24→1.24, 1.24→2.24); each conversation decodes when its tool returns
    assert simulate_rollout(workload(tool_workers=1, overlap=True), COST) == pytest.approx(2.24 + 0.235)
    assert simulate_rollout(workload(tool_workers=1, overlap=False), COST) == pytest.approx(2.24 + 0.27)


def test_prefix_cache_reprefills_only_new_tokens():
    # decode 2 re-prefills 10 generated + 5 appended tokens per conversation instead of 35
    assert simulate_rollout(workload(prefix_cache=True), COST) == pytest.approx(0.24 + 1.0 + 0.2 + 0.03)


def test_turn_lengths_by_turn_index():
    # turn 1 decodes 10 tokens, turn 2 only 2: decode 2 is 0.1 + 2·0.01 + 2·(20 + 10 + 5)·0.001 = 0.19
    w = workload(turn_tokens=[99], turn_tokens_by_turn=[[10], [2]])
    assert simulate_rollout(w, COST) == pytest.approx(0.24 + 1.0 + 0.19)


def test_single_turn_has_no_tool_time_and_price_is_a_mean():
    assert simulate_rollout(workload(turns=[1]), COST) == pytest.approx(0.24)
    w = workload(tool_seconds=[0.0, 2.0], turns=[1, 3])
    draws = [simulate_rollout(w, COST, seed=k) for k in range(5)]
    assert price_rollout(w, COST, draws=5) == pytest.approx(sum(draws) / 5)
    assert len(set(draws)) > 1


def test_final_turn_lengths_and_tools_done_together_decode_together():
    # the answer turn decodes 3 tokens: decode 2 is 0.1 + 3·0.01 + 2·35·0.001 = 0.20
    assert simulate_rollout(workload(final_turn_tokens=[3]), COST) == pytest.approx(0.24 + 1.0 + 0.20)
    # overlap, both tools back at 1.24 with the engine idle: the runner wakes on the first and decodes it
    # alone (0.1 + 0.1 + 35·0.001), the second lands meanwhile and is decoded next
    assert simulate_rollout(workload(overlap=True), COST) == pytest.approx(1.24 + 2 * 0.235)


def test_the_runners_work_around_calls_by_hand():
    # lockstep: the two prompts rendered before decode 1 (2 · 0.01, so the tools end at 1.26); before decode 2
    # the runner handles decode 1's two turns and decode 2's two (4 · 0.01); after it decode 2's two (2 · 0.01)
    w = workload(driver_seconds_per_row=0.01)
    assert simulate_rollout(w, COST) == pytest.approx(0.02 + 0.24 + 1.0 + 0.04 + 0.27 + 0.02)
    # overlap, one decode per conversation after the first: the prompts (0.02), decode 1 ends 0.26, the tools
    # 1.26; (2 + 1) · 0.01 before the second call, (1 + 1) · 0.01 before the third, 0.01 after it
    w = workload(overlap=True, driver_seconds_per_row=0.01)
    assert simulate_rollout(w, COST) == pytest.approx(1.26 + 0.03 + 0.235 + 0.02 + 0.235 + 0.01)
    assert simulate_rollout(workload(turns=[1], driver_seconds_per_row=0.01), COST) == pytest.approx(0.02 + 0.24 + 0.02)


def test_each_draw_takes_one_observed_rollouts_turn_shares():
    # two observed rollouts, one all answers and one all calls: every draw is one of them, never a mix
    w = workload(turn_shares=[{1: 1.0}, {2: 1.0}])
    draws = {round(simulate_rollout(w, COST, seed=k), 9) for k in range(8)}
    assert draws == {0.24, round(0.24 + 1.0 + 0.27, 9)}
    # shares of an odd count still give every conversation its turns: 3 conversations at 1/2 each way
    w = workload(conversations=3, turn_shares=[{1: 0.5, 2: 0.5}], overlap=True)
    assert simulate_rollout(w, COST) > 1.0


def test_runners_in_flight_share_the_engine_by_hand():
    # two runners of one conversation each, each with its own tool worker; their calls take the engine in
    # turn. Runner 0 decodes 0 → 0.22 (0.1 + 10·0.01 + 20·0.001); runner 1 waits for it, 0.22 → 0.44.
    # Tools end at 1.22 and 1.44; runner 0's second turn 1.22 → 1.455 (0.1 + 0.1 + 35·0.001), runner 1's
    # waits for it: 1.455 → 1.69
    w = workload(tool_workers=1, overlap=True, runners=2)
    assert simulate_rollout(w, COST) == pytest.approx(1.69)
    # one runner, one worker: the second tool waits for the first (test_overlap_with_one_tool_worker_by_hand)
    assert simulate_rollout(w.model_copy(update={"runners": 1}), COST) == pytest.approx(2.24 + 0.235)
    # each runner pays its own work around its calls, 0.01 per conversation: its prompt (runner 0 decodes
    # 0.01 → 0.23, runner 1 0.23 → 0.45), 2 rows before its second call (runner 0 1.25 → 1.485, runner 1 ready
    # at 1.47, waits: 1.485 → 1.72) and its last call's row after it
    w = w.model_copy(update={"driver_seconds_per_row": 0.01})
    assert simulate_rollout(w, COST) == pytest.approx(1.73)
