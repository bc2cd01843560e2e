"""The agent workload in the plan file: `search --agent-workload` writes it into the plan (`Plan.agent`), the
plan round-trips, `simulate` prices that plan's rollout multi-turn as the search did, and a plan file
written before the field existed still loads (single-turn)."""

from __future__ import annotations

import json

import pytest

from hybridflow.simulator.agents.planning import AgentWorkload
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.tools.cli import main

AGENT_YAML = """turns: [2, 4]
tool_seconds: [20.0]
turn_tokens: [256]
tool_turn_tokens: [128]
tool_workers: 64
"""
SEARCH = ["search", "--model", "llama2-7b", "--gpus-per-node", "8", "--algo", "grpo", "--samples", "4", "--batch", "64",
          "--prompt-len", "256", "--response-len", "512"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """(the plan file `search --agent-workload` wrote, the search's own iteration seconds for it)."""
    root = tmp_path_factory.mktemp("agent-plan")
    (root / "agent.yaml").write_text(AGENT_YAML)
    out = root / "plan.json"
    assert main([*SEARCH, "--agent-workload", str(root / "agent.yaml"), "--out", str(out)]) == 0
    return out


def simulated_iteration(capsys, plan_file) -> float:
    capsys.readouterr()
    assert main(["simulate", str(plan_file), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["iteration_seconds"]


def test_search_writes_the_agent_workload_and_it_round_trips(searched):
    plan = Plan.load(searched)
    assert plan.agent == AgentWorkload(turns=[2, 4], tool_seconds=[20.0], turn_tokens=[256], tool_turn_tokens=[128],
                                       tool_workers=64)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_simulate_prices_the_plan_multi_turn(searched, tmp_path, capsys):
    plan = Plan.load(searched)
    multi = simulated_iteration(capsys, searched)
    assert multi == pytest.approx(simulate(plan).iteration_seconds())
    assert simulate(plan).op_seconds().get("generate", 0.0) > 0
    # the same plan without its agent workload: generation priced single-turn (one call, no tool waits)
    single = tmp_path / "single.json"
    single.write_text(plan.model_copy(update={"agent": None}).model_dump_json())
    plain = simulated_iteration(capsys, single)
    # 2-4 turns of 256 tokens and 20 s tool calls between them: far more than one 512-token rollout
    assert multi > plain + 20.0


def test_a_plan_file_without_the_field_loads_single_turn(searched, tmp_path):
    doc = json.loads(searched.read_text())
    doc.pop("agent")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    plan = Plan.load(old)
    assert plan.agent is None
    assert simulate(plan).iteration_seconds() < simulate(Plan.load(searched)).iteration_seconds()
