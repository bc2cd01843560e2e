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
    w = agent_workload([a, b], [0.5, 0.25], AgentSettings(tools=("calculator",), tool_workers=2, overlap=False))
    assert (w.turns, w.turn_tokens_by_turn, w.tool_seconds, w.tool_workers, w.overlap) == (
        [2, 1], [[3, 1], [2]], [0.5, 0.25], 2, False)


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
