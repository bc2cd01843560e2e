"""docs/byo.md as a user runs it: its shell and Python blocks, in order, in a fresh folder (the guide's
`examples/` reached through a link). A tiny Qwen2 with a BPE tokenizer and a chat template, saved in
shards; chat prompts with answers in a `datasets` folder with train and test splits; a reward from a
file; planned with `search --actor`, trained with GRPO for 2 iterations with the test split evaluated,
exported, loaded and run by transformers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "byo.md"
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.S)


def guide_steps() -> list[tuple[str, str]]:
    """(language, code) of each fenced block; shell blocks one command per (joined) line."""
    steps = []
    for lang, code in BLOCK.findall(GUIDE.read_text()):
        if lang == "python":
            steps.append((lang, code))
        else:
            steps += [(lang, line) for line in code.replace("\\\n", " ").splitlines() if line.strip()]
    return steps


@pytest.mark.slow
def test_the_bring_your_own_guide_runs_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HFLOW_CACHE": str(tmp_path / "cache")}  # nothing of the built-in policy is needed
    outputs = []
    for lang, code in guide_steps():
        cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-c", code]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"`{code.strip()[:80]}` exited {proc.returncode}:\n{proc.stderr[-2000:]}"
        outputs.append(proc.stdout)
    model = tmp_path / "byo" / "model"
    assert (model / "model.safetensors.index.json").is_file() and len(list(model.glob("*.safetensors"))) > 1
    plan = json.loads((tmp_path / "byo" / "plan.json").read_text())
    # the plan names its files relative to its own folder (it runs from anywhere, and moves with them)
    assert {r: p["path"] for r, p in plan["roles"].items()} == {"actor": "model", "ref": "model"}
    assert plan["reward_function"] == "../examples/byo/reward.py:exact_match" and plan["profile"] == "cpu-2core"
    run_output = next(o for o in outputs if "predicted vs measured" in o)
    assert "samples of iteration 1" in run_output and "over 2 iteration(s)" in run_output
    # the held-out split evaluated before the first update, after each and at the end
    assert run_output.count("held-out (20 prompts): greedy accuracy") == 3, run_output
    metrics = [json.loads(line) for line in (tmp_path / "byo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if "eval/accuracy" in m] == [0, 1, 2]
    first, last = map(float, re.search(r"reward (\S+) → (\S+) over 2", run_output).groups())
    assert max(first, last) > 0, "the supervised start should answer some sums right"
    trained = tmp_path / "byo" / "trained" / "actor"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (trained / name).is_file(), name
    assert outputs[-1].startswith("Qwen2ForCausalLM ")
