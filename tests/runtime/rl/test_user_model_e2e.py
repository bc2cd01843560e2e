"""End to end with a user's own model folder (tiny HF Llama + BPE tokenizer with a chat template) on a local
Ray cluster: GRPO decodes responses with the folder's tokenizer and scores them with a user reward that
reads the data's extra columns; sampled responses go to the metrics, the console and TensorBoard. A
reward that raises, returns NaN or a non-number, or a reward model scoring NaN, ends the run with one
line naming it, the sample and its data row — the last checkpoint and the metrics file intact."""

import json

import pytest
from hf_util import build_hf_folder
from rl_util import tiny_plan

from hybridflow.simulator import Workload
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORKLOAD = Workload(prompts=2, samples_per_prompt=2, prompt_len=48, response_len=8, micro_batch_size=4)
REWARD = '''
CALLS = [0]
MODE = ["ok"]


def score(prompt, response, answer, bonus, **_):
    """bonus + len(response) / 1000; raises on the 10th call (iteration 3, sample 1, with 4 per iteration)."""
    CALLS[0] += 1
    assert isinstance(response, str) and isinstance(answer, str)
    if CALLS[0] == 10 and MODE[0] == "count":
        raise RuntimeError("judge unavailable")
    return {"ok": bonus + len(response) / 1000, "count": bonus + len(response) / 1000,
            "nan": float("nan"), "text": "good"}[MODE[0]]
'''
QUESTIONS = [(a, b) for a in range(2, 6) for b in range(3, 6)]


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    return build_hf_folder(tmp_path_factory.mktemp("user") / "model")


def _rows(chat: bool) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"what is {a} plus {b}?"}] if chat else f"what is {a} plus {b}?",
             "answer": str(a + b), "bonus": i / 100} for i, (a, b) in enumerate(QUESTIONS)]


def _plan(folder, **kw):
    return tiny_plan("grpo", [["actor", "ref"]], workload=WORKLOAD, model=ModelSpec.from_hf_config(folder),
                     paths={"actor": str(folder)}, **kw)


def test_cli_grpo_on_a_user_folder_until_the_reward_raises(ray_local, user_model, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridflow.tools.cli import main

    datasets.Dataset.from_list(_rows(chat=True)).save_to_disk(str(tmp_path / "data"))
    (tmp_path / "reward.py").write_text(REWARD.replace('MODE = ["ok"]', 'MODE = ["count"]'))
    plan = tmp_path / "plan.json"
    plan.write_text(_plan(user_model, reward_function=f"{tmp_path}/reward.py:score").model_dump_json())
    (tmp_path / "run.yaml").write_text("logging: {sample_log_every: 1, sample_log_count: 2}\n")
    metrics, ckpt, tb = tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "tb"
    capsys.readouterr()  # leave out the set-up's own output
    rc = main(["run", str(plan), "--iterations", "3", "--prompts", str(tmp_path / "data"), "--metrics", str(metrics),
               "--checkpoint-dir", str(ckpt), "--config", str(tmp_path / "run.yaml"), "--tensorboard", str(tb)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert (f"reward function '{tmp_path}/reward.py:score' raised RuntimeError (judge unavailable) on sample 1 "
            f"(row ") in err and f" of {tmp_path / 'data'}, prompt 'what is " in err
    # two iterations finished: their metrics lines, their checkpoint, their TensorBoard scalars
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [1, 2]
    assert (ckpt / "latest").read_text().strip() == "iter_000002"
    bonus = {r["prompt"][0]["content"]: r["bonus"] for r in _rows(chat=True)}
    for m in lines:
        assert len(m["samples"]) == 2
        for s in m["samples"]:  # decoded by the folder's tokenizer, special tokens dropped, scored by the user
            assert not any(t in s["response"] for t in ("<|im_end|>", "<|im_start|>", "<pad>", "</s>", "<s>"))
            assert s["reward"] == pytest.approx(bonus[s["prompt"][0]["content"]] + len(s["response"]) / 1000)
    assert "samples of iteration 1" in out and "samples of iteration 2" in out
    ea = EventAccumulator(str(tb))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("reward_mean")] == [(m["iteration"], pytest.approx(m["reward_mean"]))
                                                                       for m in lines]


def test_trainer_reward_nan_or_not_a_number_ends_the_iteration_cleanly(ray_local, user_model, tmp_path):
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(chat=False)))
    (tmp_path / "reward.py").write_text(REWARD)
    ref = f"{tmp_path}/reward.py:score"
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    cfg = RunConfig(data={"prompts_file": str(data), "chat_template": True})  # plain text through the chat template
    with Trainer(_plan(user_model, reward_function=ref), cfg, metrics_path=metrics, checkpoint_dir=ckpt) as t:
        mode = t.functions["reward"].__globals__["MODE"]  # the user module the trainer loaded
        t.run(1)
        for bad, msg in [("nan", "returned nan for sample 0 \\(row \\d+ of .*data.jsonl, prompt 'what is \\d plus "
                                 "\\d\\?'\\); it must return a finite number"),
                         ("text", "returned 'good' for sample 0 .*; it must return a number")]:
            mode[0] = bad
            with pytest.raises(HflowError, match=f"reward function '{ref}' {msg}") as e:
                t.step()
            assert "\n" not in str(e.value)
            assert len(metrics.read_text().splitlines()) == 1 and (ckpt / "latest").read_text() == "iter_000001\n"
        mode[0] = "ok"
        assert t.step()["iteration"] == 2  # the failed attempts counted no iteration
    assert (ckpt / "latest").read_text() == "iter_000002\n"


def test_trainer_reward_model_nan_scores_are_one_line(ray_local, user_model, tmp_path):
    import torch

    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.rl.trainer import Trainer
    from hybridflow.runtime.workers.common import load_score_model

    rm = load_score_model(user_model)
    with torch.no_grad():
        rm.score.weight.fill_(float("nan"))
    save_pretrained(rm, tmp_path / "rm")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(chat=True)))
    plan = tiny_plan("grpo", [["actor", "ref", "reward"]], workload=WORKLOAD, model=ModelSpec.from_hf_config(user_model),
                     paths={"actor": str(user_model), "reward": str(tmp_path / "rm")})
    from hybridflow.runtime.rl.run_config import RunConfig

    with Trainer(plan, RunConfig(data={"prompts_file": str(data)}), metrics_path=tmp_path / "m.jsonl") as t:
        with pytest.raises(HflowError, match=f"reward model {tmp_path / 'rm'} scored nan for sample 0 \\(row \\d+ of "
                                             ".*data.jsonl, prompt 'what is .*'\\); a score model must give finite"):
            t.step()
    assert not (tmp_path / "m.jsonl").exists()
