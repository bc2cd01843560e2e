"""The pieces of tools/bench/agent_overlap.py that decide what it prints: the multi-turn workload read
back from a run's `agent/*` metrics (tools/reports/agent_prediction.py, `run`'s prediction too), and the
planner's sync and async plans for the tool model on two devices."""

from __future__ import annotations

import statistics

import pytest

from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.tools.reports.agent_prediction import agent_workload_from_metrics


def metrics(turns: float, seconds: float) -> dict:
    return {"response_length": 26.0, "agent/turns_mean": turns, "agent/multi_turn_share": turns - 1.0,
            "agent/tool_calls_mean": turns - 1.0, "agent/tool_errors_mean": 0.25 * (turns - 1.0),
            "agent/tool_seconds_mean": seconds, "agent/generated_share": 0.5,
            "agent/call_turn_tokens": {"q05": 20.0, "q95": 24.0}, "agent/final_turn_tokens": {"q05": 2.0, "q95": 6.0}}


def test_workload_from_metrics_by_hand():
    settings = AgentSettings(tools=("calculator",), tool_workers=3, overlap=False)
    rows = [metrics(9.0, 99.0), metrics(1.4, 0.15), metrics(1.6, 0.225)]  # the first iteration left out
    w = agent_workload_from_metrics(rows, settings)
    assert statistics.mean(w.turns) == pytest.approx(1.5)
    assert w.turns.count(1) == 10  # half the conversations have one turn; the others two
    # 0.1875 s over 0.375 calls that ran (0.5 calls, a quarter failed): 0.5 s per call that ran, in
    # 0.375 / 0.5 of the tool turns
    assert max(w.tool_seconds) == pytest.approx(0.5)
    assert sum(s > 0 for s in w.tool_seconds) == 15
    assert sorted(w.turn_tokens) == [20, 20, 24, 24] and sorted(w.final_turn_tokens) == [2, 2, 6, 6]
    assert w.tool_turn_tokens == [52]  # 26 tokens appended (half the response) over 0.5 tool turns
    assert (w.tool_workers, w.overlap) == (3, False)
    shares = [{**m, "agent/turns_share": {"1": 0.5, "2": 0.375, "3": 0.125}} for m in rows]
    assert agent_workload_from_metrics(shares, settings).turns == [1] * 50 + [2] * 38 + [3] * 12
    # each iteration's own shares kept for the draws (the first iteration left out); the runner's work between
    # calls: the median over the iterations, 0 without the metric
    shares[1]["agent/turns_share"] = {"1": 1.0}
    assert agent_workload_from_metrics(shares, settings).turn_shares == [{1: 1.0}, {1: 0.5, 2: 0.375, 3: 0.125}]
    assert w.driver_seconds_per_row == 0.0
    timed = [{**m, "agent/driver_seconds_per_row": s} for m, s in zip(rows + rows[1:2], (9.0, 0.001, 0.5, 0.002),
                                                                        strict=True)]
    assert agent_workload_from_metrics(timed, settings).driver_seconds_per_row == pytest.approx(0.002)
    # the prompts' rendered width: the median over the iterations (the first left out); None without the metric
    assert w.prompt_tokens is None
    wide = [{**m, "agent/prompt_tokens": n} for m, n in zip(rows + rows[1:2], (999.0, 74.0, 80.0, 76.0), strict=True)]
    assert agent_workload_from_metrics(wide, settings).prompt_tokens == 76
    assert agent_workload_from_metrics([{"reward_mean": 1.0}], settings) is None


def test_the_planner_gives_sync_and_async_plans(tmp_path):
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model
    from hybridflow.simulator.agents.planning import AgentWorkload
    from hybridflow.tools.bench.agent_overlap import plans

    folder = build_tool_model(tmp_path / "model", seed=0)
    agent = AgentWorkload(turns=[1, 2, 3], tool_seconds=[0.5], turn_tokens=[24], tool_workers=8)
    chosen = plans(folder, agent, "cpu-2core", 4, 4, 4, 4, 4)
    assert set(chosen) == {"sync", "async"}
    assert chosen["async"].mode == "async" and chosen["async"].roles["actor"].generate_group
    assert all(p.profile == "cpu-2core" and p.cluster.num_devices == 2 for p in chosen.values())
