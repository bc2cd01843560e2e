"""Model folders through the plan, checked before anything starts: `search --actor FOLDER` records the
folder, `run --actor FOLDER` overrides it, and a folder that does not fit is one line, exit 2, with
neither torch nor Ray imported (the CLI runs in a subprocess that reports what it imported)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.tools.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from rl_util import policy_folder, tiny_plan  # noqa: E402

SEARCH = ["search", "--algo", "grpo", "--gpu", "a100-80g", "--nodes", "1", "--gpus-per-node", "1", "--batch", "4",
          "--prompt-len", "16", "--response-len", "8", "--max-pp", "1", "--max-gen-pp", "1",
          "--reward-function", "hybridflow.runtime.tasks.builtin:sort_reward"]

# Runs the CLI, then prints which heavy modules it imported (the CLI's one line stays on stderr).
CLI_WRAPPER = """
import sys
from hybridflow.tools.cli import main
code = main(sys.argv[1:])
print(sorted(m for m in ("torch", "ray") if m in sys.modules))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return policy_folder(tmp_path_factory.mktemp("models") / "policy")


def _plan_paths(plan_file) -> dict:
    return {r: rp["path"] for r, rp in json.loads(Path(plan_file).read_text())["roles"].items()}


def test_search_records_each_folder_in_the_plan(tmp_path, folder, monkeypatch):
    monkeypatch.chdir(folder.parent)  # a relative folder is recorded absolute
    assert main([*SEARCH, "--model", "policy", "--out", str(tmp_path / "a.json"), "--json"]) == 0
    assert _plan_paths(tmp_path / "a.json") == {"actor": str(folder), "ref": str(folder)}
    # A preset records no path; a role given as a folder records its own.
    assert main([*SEARCH, "--model", "tiny", "--actor", str(folder / "config.json"), "--out", str(tmp_path / "b.json"),
                 "--json"]) == 0
    assert _plan_paths(tmp_path / "b.json") == {"actor": str(folder), "ref": None}


def run_cli(*argv) -> tuple[int, str, list[str]]:
    """(exit code, stderr, heavy modules imported) of `hflow-plan argv` in a fresh interpreter."""
    p = subprocess.run([sys.executable, "-c", CLI_WRAPPER, *map(str, argv)], capture_output=True, text=True,
                       timeout=120)
    return p.returncode, p.stderr.strip(), json.loads(p.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_run_role_folder_errors_are_one_line_before_torch_or_ray(tmp_path, folder):
    import torch

    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.models.llama import LlamaConfig, LlamaForCausalLM
    from hybridflow.runtime.tasks.tokenizer import CharTokenizer

    shallow = tmp_path / "shallow"
    torch.manual_seed(0)
    save_pretrained(LlamaForCausalLM(LlamaConfig.from_spec(tiny_plan().roles["actor"].model, num_hidden_layers=2)),
                    shallow)
    CharTokenizer().save(shallow)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]], paths={"ref": str(tmp_path / "gone")}).model_dump_json())
    for argv, msg in [
        (["--critic", folder], "the plan has no 'critic' model"),
        (["--actor", tmp_path / "nowhere", "--ref", folder], "--actor " + str(tmp_path / "nowhere") + ": no such folder"),
        ([], "the plan's ref path"),
        (["--actor", shallow, "--ref", folder], "has layers = 2 but the plan's actor has 4"),
    ]:
        code, err, imported = run_cli("run", plan_file, *argv)
        assert code == 2 and len(err.splitlines()) == 1 and msg in err, err
        assert imported == [], f"{argv}: imported {imported} before refusing"
