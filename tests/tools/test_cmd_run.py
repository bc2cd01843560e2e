"""`hflow-plan run`: input errors are one line (the run itself is tested in tests/runtime/test_rl_e2e.py,
where the Ray fixture lives)."""

import sys
from pathlib import Path

from hybridflow.tools.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from rl_util import tiny_plan  # noqa: E402


def test_run_input_errors_are_one_line(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]]).model_dump_json())
    for argv, msg in [
        (["run", str(plan_file), "--resume"], "--resume needs --checkpoint-dir"),
        (["run", str(plan_file), "--keep-last", "2"], "--keep-last needs --checkpoint-dir"),
        (["run", str(plan_file), "--checkpoint-dir", str(plan_file)], "is a file; give a folder"),
        (["run", str(plan_file), "--metrics", str(tmp_path)], "is a folder"),
        (["run", str(plan_file), "--prompts", str(plan_file)], "give a .jsonl or .parquet file"),
        (["run", str(plan_file), "--keep-last", "0", "--checkpoint-dir", "c"], "expected a positive whole number"),
        (["run", str(plan_file), "--timeline", "x.svg"], "ending in .png"),
        (["run", str(plan_file), "--task", "chess"], "unknown task 'chess'"),
        (["run", str(tmp_path / "none.json")], "no such file"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
