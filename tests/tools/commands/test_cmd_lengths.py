"""`hflow-plan lengths`: a policy's response lengths measured on its prompts, written for
`search --response-lengths`; bad input one line before torch."""

import json
import subprocess
import sys

import pytest
import yaml
from hf_util import build_hf_folder

from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.tools.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_hf_folder(tmp_path_factory.mktemp("lengths") / "actor")


def test_lengths_are_measured_written_and_planned_for(folder, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?"}) + "\n" for i in range(12)))
    out = tmp_path / "lengths.yaml"
    assert main(["lengths", str(folder), "--prompts", str(prompts), "--sample", "10", "--samples-per-prompt", "2",
                 "--max-tokens", "48", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    observed = yaml.safe_load(out.read_text())["observed"]
    assert len(observed) == summary["responses"] == 20 and all(1 <= n <= 48 for n in observed)
    assert observed == sorted(observed) and min(observed) < 48  # a random policy ends some early (two EOS ids)
    dist = LengthDistribution(observed=observed)
    assert summary["max"] == dist.longest and summary["mean"] == pytest.approx(dist.mean)
    # the same seed measures the same lengths
    again = tmp_path / "again.yaml"
    assert main(["lengths", str(folder), "--prompts", str(prompts), "--sample", "10", "--samples-per-prompt", "2",
                 "--max-tokens", "48", "--out", str(again)]) == 0
    assert yaml.safe_load(again.read_text())["observed"] == observed
    capsys.readouterr()
    assert main(["search", "--model", "llama2-7b", "--algo", "grpo", "--samples", "4", "--prompt-len", "32",
                 "--response-lengths", str(out), "--top", "1", "--json"]) == 0


@pytest.mark.parametrize("argv,msg", [
    (["nofolder", "--prompts", "p.jsonl", "--out", "l.yaml"], "no such folder; pass a Hugging Face model folder"),
    (["FOLDER", "--prompts", "missing.jsonl", "--out", "l.yaml"], "no such file"),
    (["FOLDER", "--prompts", "P", "--out", "l.txt"], "ending in .yaml or .json"),
])
def test_bad_input_is_one_line_before_torch(folder, tmp_path, argv, msg):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = [str(folder) if a == "FOLDER" else str(prompts) if a == "P" else a for a in argv]
    code = ("import sys; from hybridflow.tools.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "lengths", *argv], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0]
