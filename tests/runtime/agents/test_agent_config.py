"""The `agent` section of the run config (runtime/agents/settings.py under runtime/rl/run_config.py): set
by YAML or `--set`, checked field by field; what `run` cannot train on (runtime/agents/checks.py
check_agent_plan) is one line before torch or Ray load, through `hflow-plan run` too (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rl_util import tiny_plan

from hybridflow.runtime.agents.checks import check_agent_plan
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.rl.resolve import resolve_run
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator import Workload
from hybridflow.simulator.errors import HflowError

ROOT = Path(__file__).resolve().parents[3]
CALCULATOR = {"tools": ["calculator"], "max_tokens": 64}


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


@pytest.fixture(scope="module")
def tool_folder(tmp_path_factory):
    from hybridflow.runtime.agents.tiny_tool_model import build_tool_model

    return build_tool_model(tmp_path_factory.mktemp("agent-config") / "model", seed=0)


def agent_plan(folder, response_len: int = 64, **fields):
    from hybridflow.simulator.vocabulary.model import ModelSpec

    return tiny_plan("grpo", placement=[["actor"]], model=ModelSpec.from_hf_config(folder),
                     paths={"actor": str(folder)}, workload=Workload(prompts=4, prompt_len=64, response_len=response_len,
                                                                     samples_per_prompt=4), **fields)


def refusal(plan, agent: dict, **config) -> str:
    with pytest.raises(HflowError) as e:
        resolve_run(plan, RunConfig.model_validate({"agent": agent, **config}))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_run_takes_an_agent_section_and_refuses_what_it_cannot_train_on(tool_folder, tmp_path):
    plan = agent_plan(tool_folder)
    assert resolve_run(plan, RunConfig.model_validate({"agent": CALCULATOR})).config.agent.tools == ("calculator",)
    assert "the actor's HF folder" in refusal(tiny_plan("grpo", [["actor", "ref"]]), {"environment": "guess-number"})
    vllm = plan.model_copy(update={"roles": {"actor": plan.roles["actor"].model_copy(update={"rollout": "vllm"})}})
    with pytest.raises(HflowError, match="run on the native engine"):  # (resolve_run refuses vLLM where it is absent)
        check_agent_plan(AgentSettings(**CALCULATOR), vllm)
    assert "sampling.stop" in refusal(plan, CALCULATOR, sampling={"stop": ["</s>"]})
    assert "--response-len 256" in refusal(plan, {"tools": ["calculator"], "max_tokens": 256})
    assert "nosuch" in refusal(plan, {"tools": ["nosuch.module:fn"], "max_tokens": 64})
    bad = tmp_path / "badtool.py"
    bad.write_text("def lookup(q: str):\n    return q\nlookup.tool_schema = '{not json'\n")
    assert "tool_schema" in refusal(plan, {"tools": [f"{bad}:lookup"], "max_tokens": 64})


def test_a_template_without_tools_is_refused(tmp_path):
    from hf_util import build_hf_folder

    folder = build_hf_folder(tmp_path / "plain", chat_template=True)
    assert "does not render tools" in refusal(agent_plan(folder), CALCULATOR)


def test_hflow_plan_run_refuses_bad_agent_settings_before_torch(tool_folder, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(agent_plan(tool_folder, reward_function="hybridflow.runtime.agents.word_problems:answer_reward")
                    .model_dump_json())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tom has 12 apples and buys 30 more. How many apples now?", "answer": 42})
                       + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{prompts_file: {prompts}}}\nagent: {{tools: [nosuch.module:fn], max_tokens: 64}}\n")
    code = ("import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
            "from hybridflow.tools.cli import main\n"
            f"sys.exit(main(['run', {str(plan)!r}, '--config', {str(config)!r}, '--iterations', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "nosuch" in lines[0], proc.stderr[-2000:]
