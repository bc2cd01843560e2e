"""`hflow-plan export CHECKPOINT --out DIR` on a checkpoint laid out as the trainer writes it (a role's
FsdpEngine.save plus the model files EngineState.save copies), in a fresh interpreter without Ray;
its input errors are one line. The sharded case, from a real run, is in tests/runtime/models/test_hf_export.py."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from rl_util import policy_folder  # noqa: E402
from safetensors.torch import load_file

from hybridflow.tools.cli import main

EXPORT = """
import sys
from hybridflow.tools.cli import main
code = main(sys.argv[1:])
print("ray" in sys.modules)
sys.exit(code)
"""


def _checkpoint(tmp_path, dtype=None) -> tuple[Path, Path]:
    from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
    from hybridflow.runtime.models.hf_export import copy_model_files
    from hybridflow.runtime.models.hf_format import load_pretrained

    source = policy_folder(tmp_path / "policy", seed=3, dtype=dtype)
    engine = FsdpEngine(load_pretrained(source))  # fp32 training weights, whatever the folder's dtype
    iteration = tmp_path / "ckpt" / "iter_000003"
    engine.save(iteration / "actor")
    copy_model_files(source, iteration / "actor")
    (tmp_path / "ckpt" / "latest").write_text("iter_000003\n")
    return tmp_path / "ckpt", source


def test_export_writes_the_checkpoints_weights_without_ray(tmp_path):
    # A bf16 model comes back bf16 (the source's dtype), here exactly its own weights.
    ckpt, source = _checkpoint(tmp_path, dtype=torch.bfloat16)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", EXPORT, "export", str(ckpt), "--out", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "False"  # no Ray imported
    got, want = load_file(out / "actor" / "model.safetensors"), load_file(source / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert json.loads((out / "actor" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (out / "actor" / "hflow_tokenizer.json").read_text() == (source / "hflow_tokenizer.json").read_text()


def test_export_input_errors_are_one_line(tmp_path, capsys):
    ckpt, source = _checkpoint(tmp_path)
    (tmp_path / "taken" / "actor").mkdir(parents=True)
    for argv, msg in [
        (["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")], "no such checkpoint"),
        (["export", str(source), "--out", str(tmp_path / "x")], "not a checkpoint"),
        (["export", str(ckpt), "--out", str(tmp_path / "taken")], "already exists"),
        (["export", str(ckpt), "--out", str(source / "config.json")], "is a file"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    (ckpt / "iter_000003" / "actor" / "config.json").unlink()
    assert main(["export", str(ckpt), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json for the actor" in capsys.readouterr().err
