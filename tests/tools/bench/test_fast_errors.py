"""Bad input ends in one line and exit code 2 before torch or Ray is imported — each case of the
error benchmark (tools/bench/cli_errors.py, which times them), plus names in any case and help
that states defaults. No timing here: the benchmark measures the seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.tools.bench.cli_errors import error_cases
from hybridflow.tools.cli import build_parser, main

# All cases in one fresh interpreter: after each, neither torch nor Ray may have been imported.
RUNNER = """
import contextlib, io, json, sys
from pathlib import Path
from hybridflow.tools.bench.cli_errors import error_cases
from hybridflow.tools.cli import main
out = []
for case in error_cases(Path(sys.argv[1])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(case.argv)
    out.append({"name": case.name, "rc": rc, "err": err.getvalue(),
                "heavy": sorted(m for m in ("torch", "ray") if m in sys.modules)})
print(json.dumps(out))
"""


ROOT = Path(__file__).resolve().parents[3]


def test_bad_input_is_one_line_exit_2_without_torch_or_ray(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = {o["name"]: o for o in json.loads(proc.stdout)}
    cases = error_cases(tmp_path)
    assert [c.name for c in cases] == list(results)
    wrong = []
    for case in cases:
        got = results[case.name]
        lines = got["err"].strip().splitlines()
        if got["rc"] != 2 or len(lines) != 1 or case.expect not in lines[0] or got["heavy"]:
            wrong.append(f"{case.name}: exit {got['rc']}, imported {got['heavy']}, stderr {got['err']!r}")
    assert not wrong, "\n".join(wrong)
    names = " | ".join(results)
    for phrase in ("larger than the machine", "too large for its device", "preset without a path", "binary",
                   "a folder", "near miss", "a prefix of"):  # the cases
        assert phrase in names, phrase


def test_names_in_any_case():
    parser = build_parser()
    assert parser.parse_args(["search", "--algo", "PPO", "--model", "x"]).algo == "ppo"
    assert parser.parse_args(["search", "--algo", "Safe-RLHF", "--model", "x"]).algo == "safe-rlhf"
    assert parser.parse_args(["run", "p.json", "--task", "SORT"]).task == "sort"
    assert parser.parse_args(["quickstart", "--algo", "GRPO"]).algo == "grpo"
    from hybridflow.simulator import hardware_preset, model_preset
    from hybridflow.simulator.vocabulary.plan import algorithm_name

    assert hardware_preset("H100-80G").name == "h100-80g" and model_preset("LLaMA2-7B").name == "llama2-7b"
    assert algorithm_name("ReMax") == "remax"


def test_plan_files_take_names_in_any_case(tmp_path, capsys):
    plan = json.loads((ROOT / "examples/plans/grpo-llama2-7b-1x8.json").read_text())
    plan["algorithm"], plan["roles"]["actor"]["model"] = "GRPO", "Llama2-7B"
    plan["cluster"]["hardware"] = "A100-80G"
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan))
    assert main(["simulate", str(f), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["algorithm"] == "grpo"
    plan["algorithm"] = "gpro"
    f.write_text(json.dumps(plan))
    assert main(["simulate", str(f)]) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'gpro'; did you mean" in err and "'grpo'?" in err


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("hflow-plan ")
    assert main(["search", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 8)" in out and "examples:" in out and "hflow-plan search " in out


def test_the_benchmark_times_a_case_as_its_own_process(tmp_path):
    from hybridflow.tools.bench.cli_errors import time_case

    row = time_case(error_cases(tmp_path)[0])
    assert row["ok"] and row["exit_code"] == 2 and row["wall_seconds"] > 0 and "--checkpoint-dir" in row["message"]


def test_cluster_flags_reach_the_run_config_and_bad_values_are_one_line(capsys):
    from hybridflow.tools.commands.run import run_config

    args = build_parser().parse_args(["run", "p.json", "--start-timeout", "900", "--call-timeout", "1800.5",
                                      "--max-restarts", "2"])
    cfg = run_config(args)
    assert (cfg.cluster.start_timeout_s, cfg.cluster.call_timeout_s, cfg.cluster.max_restarts) == (900.0, 1800.5, 2)
    defaults = run_config(build_parser().parse_args(["run", "p.json"]))
    assert (defaults.cluster.start_timeout_s, defaults.cluster.call_timeout_s, defaults.cluster.max_restarts) == (600.0, None, 0)
    for argv, what in ((["--call-timeout", "0"], "positive number of seconds"),
                       (["--start-timeout", "inf"], "positive number of seconds"),
                       (["--max-restarts", "two"], "a whole number (0 or more)"),
                       (["--checkpoint-dir", "s3://bucket/ckpt"], "s3:// needs the package s3fs: pip install s3fs"),
                       (["--export-hf", "gs://bucket/out"], "gs:// needs the package gcsfs: pip install gcsfs"),
                       (["--checkpoint-dir", "nope://x"], "fsspec knows no protocol 'nope'"),
                       (["--checkpoint-dir", "memory://ckpt"], "memory:// lives in one process")):
        assert main(["run", "p.json", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert what in err and "\n" not in err, err


def test_a_url_checkpoint_dir_is_read_through_fsspec(tmp_path, capsys):
    # file:// is read as a URL (fsspec), not as a relative folder named "file:"
    url = f"file://{tmp_path}/ckpt"
    assert main(["run", "p.json", "--checkpoint-dir", url, "--resume"]) == 2
    assert f"nothing to resume in {url}: no complete checkpoint" in capsys.readouterr().err
    (tmp_path / "ckpt").write_text("")
    assert main(["run", "p.json", "--checkpoint-dir", url]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_every_benchmark_prints_its_help(capsys):
    """`--help` of each tools/bench script: argparse renders every help string (a bare % in one is a TypeError)."""
    import importlib
    import pkgutil

    import hybridflow.tools.bench as bench

    names = [m.name for m in pkgutil.iter_modules(bench.__path__)]
    assert "long_tail" in names and "partial_rollouts" in names
    for name in names:
        module = importlib.import_module(f"hybridflow.tools.bench.{name}")
        if not hasattr(module, "main"):
            continue
        with pytest.raises(SystemExit) as ended:
            module.main(["--help"])
        assert ended.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name
