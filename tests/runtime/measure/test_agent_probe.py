"""The multi-turn probes (runtime/measure/agent_probe.py): the distributions read off finished
conversations, a tool's latency timed on real calls, and a decode cost fitted to a real engine's calls
that prices more decode steps and more rows higher."""

from __future__ import annotations

import pytest
import torch
from engine_util import tiny_model

from hybridflow.runtime.agents.conversation import Conversation
from hybridflow.runtime.agents.loading import load_tool
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.engines.rollout.generation import GenerationEngine
from hybridflow.runtime.measure.agent_probe import (
    agent_workload,
    fit_decode_cost,
    observed_distributions,
    probe_workload,
    tool_latency,
)
from hybridflow.runtime.sandbox import SandboxLimits


def test_observed_distributions():
    a = Conversation({}, [1, 2], [])
    a.add_model_turn([10, 11, 12], [0.0] * 3, "call")
    a.add_context([20, 21], [])
    a.add_model_turn([13, 14], [0.0] * 2, "4")
    b = Conversation({}, [1], [])
    b.add_model_turn([15], [0.0], "7")
    assert observed_distributions([a, b]) == {"turns": [2, 1], "turn_tokens": [3, 2, 1], "tool_turn_tokens": [2],
                                              "turn_tokens_by_turn": [[3, 1], [2]]}
    settings = AgentSettings(tools=("calculator",), tool_workers=2, overlap=False)
    # two runs of the runner: 0.03 s between calls over 4 conversations handled there, then 0.01 s over 2
    stats = [{"driver_s": 0.03, "driver_rows": 4}, {"driver_s": 0.01, "driver_rows": 2}]
    w = agent_workload([a, b], settings, stats, tool_seconds=[0.5, 0.25])
    assert (w.turns, w.turn_tokens_by_turn, w.tool_seconds, w.tool_workers, w.overlap) == (
        [2, 1], [[3, 1], [2]], [0.5, 0.25], 2, False)
    assert w.driver_seconds_per_row == pytest.approx(0.04 / 6)
    assert w.prompt_tokens == 2  # the longer prompt: rows are padded to it
    # without tool_latency's figures: the seconds each tool turn took in the conversations
    a.tool_spans = [(10.0, 10.5)]
    w = agent_workload([a, b], settings, [{"driver_s": 0.0, "driver_rows": 0}])
    assert (w.tool_seconds, w.driver_seconds_per_row) == ([pytest.approx(0.5)], 0.0)


@pytest.mark.slow
def test_probe_measures_the_runners_work_between_calls(tmp_path):
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model

    folder = build_tool_model(tmp_path / "model", seed=0)
    settings = AgentSettings(environment="guess-number", max_turns=3, max_tokens=64, turn_tokens=8, overlap=False)
    rows = [{"prompt": ""} for _ in range(4)]
    w = probe_workload(folder, settings, rows, rollouts=2)
    # the environment answers every turn: conversations of several turns, so calls follow calls and the
    # runner's work between them (the environment's step, the template's render, tokenising) is timed
    assert max(w.turns) > 1
    assert 1e-6 < w.driver_seconds_per_row < 0.5


def test_tool_latency_times_real_calls(tmp_path):
    f = tmp_path / "sleepy.py"
    f.write_text("import time\ndef wait(s: float):\n    time.sleep(s)\n    return 'ok'\n")
    seconds = tool_latency(load_tool(f"{f}:wait@inprocess"), [{"s": 0.0}, {"s": 0.2}], SandboxLimits())
    assert seconds[0] < 0.1 <= 0.2 <= seconds[1] < 2.0


@pytest.mark.slow
def test_decode_cost_fit():
    torch.manual_seed(0)
    engine = GenerationEngine(tiny_model().eval())
    cost = fit_decode_cost(engine.generate, vocab=100, rows=(1, 8), contexts=(16, 64), steps=(4, 16), repeats=1)
    assert cost.seconds(8, 16, 8 * 64) > cost.seconds(1, 4, 16) > 0
