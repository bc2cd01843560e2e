"""Every example plan either runs on a 2-core CPU machine as documented — here for one iteration —
or is a GPU-cluster example: `run` refuses it on a small machine in one line, before Ray starts,
and examples/README.md and its notes show the `simulate` command for it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.tools.cli import main
from hybridflow.tools.preflight.checks import Machine, Node, RunChecks, preflight

ROOT = Path(__file__).resolve().parents[3]
PLANS = sorted((ROOT / "examples" / "plans").glob("*.json"))
README = (ROOT / "examples" / "README.md").read_text()
TWO_CORES = Machine("a 2-core CPU machine", (Node(cpus=2, memory=8 * 2**30),))


def runs_on_two_cores(plan: Plan) -> bool:
    try:
        preflight(RunChecks(plan, TWO_CORES))
    except HflowError:
        return False
    return True


LOCAL = [p for p in PLANS if runs_on_two_cores(Plan.load(p))]
GPU = [p for p in PLANS if p not in LOCAL]


def test_there_are_local_and_gpu_examples():
    assert LOCAL and GPU


@pytest.mark.parametrize("path", GPU, ids=[p.stem for p in GPU])
def test_gpu_examples_are_documented_and_refused_here_in_one_line(path, capsys):
    plan = Plan.load(path)
    command = f"hflow-plan simulate examples/plans/{path.name}"
    local, gpu = README.split("## GPU-cluster examples")
    assert path.name not in local and re.search(re.escape(command) + r"\b", gpu), command
    assert plan.notes.startswith("GPU-cluster example") and command in plan.notes
    assert main(["run", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("path", LOCAL, ids=[p.stem for p in LOCAL])
def test_local_examples_run_one_iteration(ray_local, path, capsys):
    plan = Plan.load(path)
    local = README.split("## GPU-cluster examples")[0]
    assert f"hflow-plan run examples/plans/{path.name}" in local and plan.reward_function  # names its reward
    assert main(["run", str(path), "--iterations", "1", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["iterations"]) == 1 and 0.0 <= out["iterations"][0]["reward_mean"] <= 1.0
    # its phases, said on stderr in --json mode
    for phrase in ("checked the plan", "worker process(es) for group", "loading actor's weights"):
        assert phrase in captured.err, phrase
