"""`hflow-plan agent-probe`: the agent workload of a real model calling the user's own (slow) tool, measured
here, written for `search --agent-workload` and read back by it; a tool that does not import is one line
before torch."""

import json
import subprocess
import sys

import pytest
import yaml

from hybridflow.tools.cli import main
from hybridflow.tools.search_request import agent_workload_arg

TOOL_SLEEP_S = 0.05
# the user's calculator: the name and argument the warmed-up model calls, slowed to a known latency
TOOL = f"""import time
def calculator(expression: str):
    '''Evaluate an arithmetic expression.'''
    time.sleep({TOOL_SLEEP_S})
    a, op, b = expression.partition('+') if '+' in expression else expression.partition('-')
    return str(int(a) + int(b) if op == '+' else int(a) - int(b))
"""


@pytest.mark.slow
def test_probe_writes_the_workload_search_prices(tmp_path, capsys, call_format_tool_model):
    import shutil

    from hybridflow.runtime.agents.word_problems import word_problems

    folder = shutil.copytree(call_format_tool_model, tmp_path / "model")  # knows the call format (tests/conftest.py)
    prompts = tmp_path / "problems.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in word_problems(8, seed=3)))
    (tmp_path / "mytools.py").write_text(TOOL)
    config = tmp_path / "run.yaml"
    config.write_text("agent: {max_turns: 3, max_tokens: 96, turn_tokens: 24, tool_workers: 2, overlap: false}\n")
    out = tmp_path / "agent.yaml"
    assert main(["agent-probe", str(folder), "--prompts", str(prompts), "--tools",
                 f"{tmp_path / 'mytools.py'}:calculator@inprocess", "--config", str(config),
                 "--set", "agent.max_turns=2", "--sample", "4", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    workload = agent_workload_arg(str(out))  # what `search --agent-workload` reads
    assert yaml.safe_load(out.read_text())["turns"] == workload.turns
    assert summary["conversations"] == len(workload.turns) == 8  # 4 prompts, 2 rollouts
    # --config's agent section, --set over it: at most 2 turns, its tool_workers and overlap carried
    assert max(workload.turns) == 2 and (workload.tool_workers, workload.overlap) == (2, False)
    # the model called the tool: those tool turns waited on the user's sleep; a turn with a malformed call none
    assert summary["tool_seconds_p50"] <= summary["tool_seconds_p90"]
    assert TOOL_SLEEP_S <= summary["tool_seconds_p90"] <= max(workload.tool_seconds) < 2.0
    assert all(1 <= n <= 24 for n in workload.turn_tokens) and workload.prompt_tokens > 16
    assert 0 < summary["driver_seconds_per_row"] == workload.driver_seconds_per_row < 0.5
    assert main(["search", "--model", "tiny", "--algo", "grpo", "--samples", "2", "--prompt-len", "64",
                 "--response-len", "96", "--agent-workload", str(out), "--top", "1", "--json"]) == 0
    # the text summary names what it measured and where it wrote it
    assert main(["agent-probe", str(folder), "--prompts", str(prompts), "--tools",
                 f"{tmp_path / 'mytools.py'}:calculator", "--sample", "2", "--rollouts", "1", "--out",
                 str(tmp_path / "agent.json")]) == 0
    text = capsys.readouterr().out
    assert "tool seconds per tool turn p50" in text and "--agent-workload" in text
    assert agent_workload_arg(str(tmp_path / "agent.json")).turns


def test_a_tool_that_does_not_import_is_one_line_before_torch(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is 2 plus 3?"}\n')
    code = ("import sys; from hybridflow.tools.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "agent-probe", "model", "--prompts", str(prompts), "--tools",
                        "no_such_module_here:lookup", "--out", "agent.yaml"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no_such_module_here" in r.stderr
