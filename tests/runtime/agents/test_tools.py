"""Tool calls parsed in the Hermes / Qwen format, tools a user brings (`module:function`, `file.py:function`)
with their schemas, the shipped calculator and Python tools, and the checks of an agent run's bad input
(one line, exit 2, before torch loads) — the last through the example's real command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.runtime.agents.builtin_tools import evaluate
from hybridflow.runtime.agents.checks import check_agent
from hybridflow.runtime.agents.environments import GuessNumber, load_environment
from hybridflow.runtime.agents.loading import load_tool, load_tools
from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.agents.tool_calls import parse_tool_calls
from hybridflow.runtime.sandbox import SandboxLimits
from hybridflow.simulator.errors import HflowError

ROOT = Path(__file__).resolve().parents[3]
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=2.0, memory_mb=256)


def test_parse_hermes_calls():
    text = ('thinking <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+3"}, ""), ("python", {"code": "print(1)"}, "")]
    assert parse_tool_calls("the answer is 5") == []
    bad = parse_tool_calls("<tool_call>{name: calculator}</tool_call>")
    assert len(bad) == 1 and "not JSON" in bad[0].error
    assert "not closed" in parse_tool_calls('<tool_call>{"name": "calculator"')[0].error
    assert "needs" in parse_tool_calls('<tool_call>[1, 2]</tool_call>')[0].error


def test_calculator():
    tool = load_tool("calculator")
    assert tool.run({"expression": "(23 + 19) * 2"}, LIMITS) == "84"
    assert tool.run({"expression": "7 / 2"}, LIMITS) == "3.5"
    assert tool.run({"expression": "__import__('os')"}, LIMITS).startswith("error (exception)")
    assert "exponent" in tool.run({"expression": "9 ** 9 ** 9"}, LIMITS)
    assert tool.run({}, LIMITS) == "error (arguments): calculator needs expression"
    assert tool.run({"expression": "1", "x": 2}, LIMITS).startswith("error (arguments)")
    with pytest.raises(ValueError):
        evaluate("abs(-1)")


def test_python_tool_runs_in_the_sandbox():
    tool = load_tool("python")
    assert tool.run({"code": "print(6 * 7)"}, LIMITS) == "42\n"
    assert tool.run({"code": "import time\ntime.sleep(30)"}, LIMITS).startswith("error (timeout)")
    assert tool.run({"code": "import socket\nsocket.socket()"}, LIMITS).startswith("error (refused)")


def test_user_tools_with_and_without_schema(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text('''
import json, time

def add(a: int, b: int = 1) -> int:
    """Add two integers.

    More text."""
    return a + b

def lookup(key):
    return {"k": key}
lookup.tool_schema = {"type": "function", "function": {"name": "lookup", "description": "Look up",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}

def hang(x: str):
    while True:
        pass
''')
    tools = load_tools([f"{f}:add", f"{f}:lookup@inprocess", f"{f}:hang"])
    assert tools["add"].schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a"]}}}
    assert tools["add"].run({"a": 2, "b": 5}, LIMITS) == "7"  # in the sandbox: its own process
    assert json.loads(tools["lookup"].run({"key": "z"}, LIMITS)) == {"k": "z"}
    out = tools["hang"].run({"x": "1"}, LIMITS)
    assert out.startswith("error (cpu)") or out.startswith("error (timeout)")


@pytest.mark.parametrize("source, spec, message", [
    ("import nonexistent_module_xyz\ndef f(x): return x\n", "f", "No module named .nonexistent_module_xyz."),
    ("def f(x): return x\nf.tool_schema = '{not json'\n", "f", "tool_schema is not JSON"),
    ("def f(x): return x\nf.tool_schema = {'name': 'f', 'parameters': {'type': 'array'}}\n", "f",
     "must be a JSON schema of type 'object'"),
    ("def f(x): return x\nf.tool_schema = {'name': 'f', 'parameters': {'type': 'object', 'properties': {},"
     " 'required': ['y']}}\n", "f", "requires 'y'"),
    ("def f(x): return x\n", "g", "has no 'g'"),
])
def test_bad_tools_are_one_line(tmp_path, source, spec, message):
    f = tmp_path / "bad_tool.py"
    f.write_text(source)
    with pytest.raises(HflowError, match=message) as e:
        load_tools([f"{f}:{spec}"])
    assert "\n" not in str(e.value)


def test_environment_loading(tmp_path):
    assert load_environment("guess-number") is GuessNumber
    env = GuessNumber()
    assert "between 1 and 16" in env.reset({"secret": 5}, 0)
    assert env.step("8") == ("lower", 0.0, False)
    assert env.step("I guess 5") == ("Correct!", 1.0, True)
    f = tmp_path / "envs.py"
    f.write_text("class NotAnEnv:\n    pass\n")
    with pytest.raises(HflowError, match="reset"):
        load_environment(f"{f}:NotAnEnv")
    with pytest.raises(ValueError, match="either agent.tools or agent.environment"):
        AgentSettings.model_validate({"tools": ["calculator"], "environment": "guess-number"})


def _plain_template_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "plain"
    folder.mkdir()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_template_without_tools(tmp_path):
    folder = _plain_template_folder(tmp_path)
    with pytest.raises(HflowError, match="does not render tools"):
        check_agent(AgentSettings(tools=("calculator",)), folder)
    check_agent(AgentSettings(environment="guess-number"), folder)  # an environment needs no tool support


@pytest.mark.parametrize("case", ["import", "schema", "template"])
def test_example_bad_input_is_one_line_exit_2_before_torch(tmp_path, case):
    f = tmp_path / "t.py"
    args = ["--tool", f"{f}:f"]
    if case == "import":
        f.write_text("raise RuntimeError('broken on import')\ndef f(x): return x\n")
    elif case == "schema":
        f.write_text("def f(x): return x\nf.tool_schema = '{\"name\": '\n")
    else:
        f.write_text("def f(x: str): return x\n")
        args += ["--model", str(_plain_template_folder(tmp_path))]
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import calculator_grpo as c; rc = c.main(sys.argv[2:]); "
            "assert 'torch' not in sys.modules, 'torch loaded'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "agents"), *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("calculator_grpo: "), out.stderr
    assert {"import": "broken on import", "schema": "not JSON", "template": "does not render tools"}[case] in lines[0]
