"""The `agent` section of the run config (runtime/agents/settings.py under runtime/rl/run_config.py): set
by YAML or `--set`, checked field by field, and refused by `run` in one line until multi-turn rollouts
are wired into the trainer (the example reads it meanwhile)."""

from __future__ import annotations

import pytest
from rl_util import tiny_plan

from hybridflow.runtime.rl.resolve import resolve_run
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.errors import HflowError


def test_agent_section_nested_and_overridable(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("agent:\n  tools: [calculator]\n  max_turns: 3\n  sandbox: {wall_seconds: 2}\n")
    cfg = RunConfig.load(f)
    assert cfg.agent.tools == ("calculator",) and cfg.agent.max_turns == 3
    assert cfg.agent.sandbox.wall_seconds == 2 and cfg.agent.sandbox.cpu_seconds == 5  # the rest kept
    cfg = cfg.with_overrides({"agent.sandbox.memory_mb": 128, "agent.overlap": False})
    assert cfg.agent.sandbox.memory_mb == 128 and not cfg.agent.overlap
    f.write_text("agent:\n  max_turn: 3\n")
    with pytest.raises(HflowError, match="max_turn"):
        RunConfig.load(f)
    assert not RunConfig().agent.enabled


def test_run_refuses_an_agent_section_in_one_line():
    plan = tiny_plan("grpo", [["actor", "ref"]])
    resolve_run(plan, RunConfig())
    with pytest.raises(HflowError, match="not wired into `run` yet") as e:
        resolve_run(plan, RunConfig.model_validate({"agent": {"environment": "guess-number"}}))
    assert "\n" not in str(e.value)
