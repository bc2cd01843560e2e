"""The planner on multi-turn agent rollouts (`hflow-plan search --agent-workload`): generation priced as
conversations (simulator/agents/planning.py), so a slow tool moves the choice of mode; without an agent
workload the search is what it was; a bad workload file is one line, exit 2."""

from __future__ import annotations

import pytest

from hybridflow.planner.modes import pick_mode, search_modes
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search
from hybridflow.simulator.agents.planning import AgentWorkload, MultiTurnCostModel
from hybridflow.simulator.calibration.gpu_fit import default_cost_model
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import resolve_model
from hybridflow.simulator.vocabulary.workload import Workload
from hybridflow.tools.cli import main

CLUSTER = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=1, devices_per_node=8)
MODEL = resolve_model("llama2-7b")
W = Workload(prompts=64, prompt_len=256, response_len=512, samples_per_prompt=4)


def request(tool_seconds: float | None) -> SearchRequest:
    agent = None if tool_seconds is None else AgentWorkload(
        turns=[2, 4], tool_seconds=[tool_seconds], turn_tokens=[256], tool_turn_tokens=[128], tool_workers=64)
    return SearchRequest(algorithm="grpo", models={"actor": MODEL, "ref": MODEL}, cluster=CLUSTER, workload=W,
                         reward_function="m:f", agent=agent)


def test_tool_latency_moves_the_mode():
    # instant tools: the conversations' turns are generation the actor's 8 devices do fastest together
    # (sync); 20 s per call on 64 workers: the rollout waits on tools, worth overlapping with training
    fast = search_modes(request(0.0), None, ["sync", "one-step-off"], 1)
    slow = search_modes(request(20.0), None, ["sync", "one-step-off"], 1)
    assert pick_mode(fast, 1) == "sync"
    assert pick_mode(slow, 1) == "one-step-off"
    assert slow["sync"].best.seconds > fast["sync"].best.seconds
    assert isinstance(slow["sync"].planners[0].cm, MultiTurnCostModel)


def test_without_an_agent_workload_the_search_is_single_turn():
    plain = search(request(None), default_cost_model(CLUSTER))
    again = search(request(None))  # no agent: the cost model is not wrapped, the price is the single-turn one
    assert again.best.seconds == plain.best.seconds
    multi = search(request(0.0), MultiTurnCostModel(default_cost_model(CLUSTER), request(0.0).agent))
    assert multi.best.seconds != pytest.approx(plain.best.seconds)


@pytest.mark.parametrize(("text", "needle"), [
    (None, "no such file"),
    ("turns: [2]\n", "tool_seconds: Field required"),
    ("turns: [0]\ntool_seconds: [1]\n", "turns.0"),
])
def test_bad_agent_workload_is_one_line(tmp_path, capsys, text, needle):
    path = tmp_path / "agent.yaml"
    if text is not None:
        path.write_text(text)
    assert main(["search", "--model", "tiny", "--gpus-per-node", "2", "--algo", "grpo", "--samples", "2",
                 "--agent-workload", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "--agent-workload" in err and len(err.splitlines()) == 1
