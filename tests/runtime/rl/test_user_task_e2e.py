"""Issue #39 end to end: a user's own task — a `datasets` folder with train and test splits, a reward file — planned
with `search --profile`, the plan folder moved, run from another directory with evaluation on the test split; the
same prediction from `search`, `simulate` and `run`; `--iterations` on `--resume` as the total."""

import json
import shutil

import pytest

from hybridflow.tools.cli import main

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REWARD = '''
def exact(prompt, response, answer, **_):
    return float(response.strip() == answer)
'''


def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def moved_plan(tmp_path_factory):
    """search in folder A (paths relative to it, the profile recorded), then A moved to B."""
    datasets = pytest.importorskip("datasets")
    from hybridflow.runtime.tasks.prompt_files import task_rows

    root = tmp_path_factory.mktemp("task")
    a = root / "A"
    a.mkdir()
    (a / "reward.py").write_text(REWARD)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(task_rows("sort", 64, seed=0)),
                          "test": datasets.Dataset.from_list(task_rows("sort", 12, seed=7))}).save_to_disk(str(a / "data"))
    return root, a


def test_moved_plan_runs_with_evaluation_and_the_same_prediction(ray_local, moved_plan, capsys, monkeypatch):
    root, a = moved_plan
    monkeypatch.chdir(root)
    assert main(["search", "--profile", "cpu-2core", "--gpus-per-node", "2", "--algo", "grpo", "--model", "tiny",
                 "--reward-function", "A/reward.py:exact", "--batch", "4", "--samples", "2", "--prompt-len", "16",
                 "--response-len", "8", "--max-pp", "1", "--max-gen-pp", "1", "--out", "A/plan.json", "--json"]) == 0
    searched = _json_out(capsys)["best"]["iteration_seconds"]
    written = json.loads((a / "plan.json").read_text())
    assert written["reward_function"] == "reward.py:exact" and written["profile"] == "cpu-2core"
    b = root / "B"
    shutil.move(str(a), str(b))
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["simulate", str(b / "plan.json"), "--json"]) == 0
    assert _json_out(capsys)["iteration_seconds"] == pytest.approx(searched, rel=1e-9)
    assert main(["run", str(b / "plan.json"), "--iterations", "2", "--prompts", str(b / "data"), "--metrics", "m.jsonl",
                 "--eval-samples", "2", "--no-speed-check", "--json"]) == 0
    out = _json_out(capsys)
    assert out["predicted"]["iteration_seconds"] == pytest.approx(searched, rel=1e-9)
    lines = [json.loads(x) for x in (elsewhere / "m.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    before, after = lines[0], lines[2]
    for m in (before, after):  # before the first update and at the end, on the 12 test-split prompts
        assert m["eval/prompts"] == 12 and 0 <= m["eval/accuracy"] <= 1 and 0 <= m["eval/pass@2"] <= 1
        assert m["eval/pass@2"] >= m["eval/sample_accuracy"] - 1e-9
        assert 0 < m["eval/response_length_mean"] <= m["eval/response_length_max"] <= 8
        assert len(m["eval_samples"]) == 3 and {"prompt", "response", "reward"} <= set(m["eval_samples"][0])
    assert "eval/accuracy" not in lines[1]  # only at the start and the end without --eval-every


def test_resume_iterations_is_the_total(ray_local, moved_plan, capsys, monkeypatch, tmp_path):
    from rl_util import tiny_plan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text(tiny_plan("grpo", [["actor", "ref"]]).model_dump_json())
    base = ["run", "plan.json", "--checkpoint-dir", "ckpt", "--metrics", "m.jsonl", "--no-speed-check", "--json"]
    assert main([*base, "--iterations", "2"]) == 0
    capsys.readouterr()
    assert main([*base, "--resume", "--iterations", "3"]) == 0  # the total: one more
    assert [m["iteration"] for m in _json_out(capsys)["iterations"]] == [3]
    assert main([*base, "--resume", "--more", "1"]) == 0  # one more after the checkpoint
    assert [m["iteration"] for m in _json_out(capsys)["iterations"]] == [4]
    assert main([*base, "--resume", "--iterations", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the checkpoint is at iteration 4 and --iterations 4 is the total to reach" in err and len(err.splitlines()) == 1


def test_quickstart_with_a_poisoned_probe_cache_measures_again(ray_local, capsys, monkeypatch, tmp_path):
    from hybridflow.runtime.controller.host import cache_dir
    from hybridflow.runtime.measure import hardware_probe as hp

    for kept in cache_dir().glob("policy-*"):  # the warmed-up policy, not the probe
        (tmp_path / kept.name).symlink_to(kept)
    monkeypatch.setenv("HFLOW_CACHE", str(tmp_path))
    # priced on the probe, as on a machine the shipped profile is not of (on its own machine quickstart takes the profile)
    from hybridflow.simulator.calibration.profile import Fingerprint
    monkeypatch.setattr(Fingerprint, "same_machine", lambda self, other: False)
    hp.probe_hardware(hp.default_devices())
    (cached,) = tmp_path.glob("hardware-*.json")
    data = json.loads(cached.read_text())
    good = data["spec"]["peak_flops"]
    data["spec"]["peak_flops"] = good / 6  # the probe taken on a busy machine: 16.8 vs 97.3 GFLOP/s
    cached.write_text(json.dumps(data))
    assert main(["quickstart", "--iterations", "2", "--eval-prompts", "8", "--json"]) == 0
    captured = capsys.readouterr()
    assert "disagrees with a quick check now" in captured.err and "measuring again" in captured.err, captured.err
    assert json.loads(cached.read_text())["spec"]["peak_flops"] > good / 3  # measured again, and cached
    out = json.loads(captured.out)
    assert [e["iteration"] for e in out["evaluations"]] == [0, 2] and out["evaluations"][0]["eval/prompts"] == 8
