"""Issue #39: every input of a user's task checked before torch or Ray — each failure that used to come seconds
into a run (after Ray and the weights loaded) now one line, exit code 2, from a fresh process in which neither
torch nor ray was ever imported, within a few seconds (about one on a quiet machine)."""

import json
import subprocess
import sys
import time

import pytest
from rl_util import tiny_plan

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.workload import Workload

REWARD = '''
import re


def last_number(prompt, response, answer, **_):
    nums = re.findall(r"-?\\d+", response)
    return float(bool(nums) and nums[-1] == str(answer))


def needs_first(prompt, response, **row):
    return float(response.strip() == row["answer"].split()[0])


def boom(prompt, response, answer, **_):
    return 1.0 / len(response)
'''
# exits with main's code, or 9 when torch or ray was imported on the way
PROBE = ("import sys; from hybridflow.tools.cli import main; rc = main(sys.argv[1:]); "
         "sys.exit(9 if {'torch', 'ray'} & set(sys.modules) else rc)")


def _hflow(cwd, *argv) -> tuple[int, str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stderr.strip(), time.perf_counter() - start


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("task")
    (d / "reward.py").write_text(REWARD)
    plan = tiny_plan("grpo", [["actor", "ref"]], workload=Workload(prompts=4, samples_per_prompt=2, prompt_len=16,
                                                                     response_len=8, micro_batch_size=8, mini_batches=1),
                     reward_function="reward.py:last_number")
    (d / "plan.json").write_text(plan.model_dump_json())
    good = [{"prompt": f"add {a}+{b}:", "answer": str(a + b)} for a in range(5) for b in range(4)]
    files = {
        "good.jsonl": "".join(json.dumps(r) + "\n" for r in good),
        "malformed.jsonl": json.dumps(good[0]) + "\n{\"prompt\": \"add 1+1:\"\n",
        "no_prompt.jsonl": json.dumps(good[0]) + "\n" + json.dumps({"question": "add 1+1:", "answer": "2"}) + "\n",
        "not_text.jsonl": json.dumps(good[0]) + "\n" + json.dumps({"prompt": {"text": "add"}, "answer": "2"}) + "\n",
        "long.jsonl": json.dumps(good[0]) + "\n" + json.dumps({"prompt": "add 1+1: " + "x" * 30, "answer": "2"}) + "\n",
        "no_answer.jsonl": json.dumps(good[0]) + "\n" + json.dumps({"prompt": "add 1+1:"}) + "\n",
    }
    for name, text in files.items():
        (d / name).write_text(text)
    return d


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "malformed.jsonl"], "malformed.jsonl: 1 of 2 row(s) unusable — line 2 is not JSON"),
    (["--prompts", "no_prompt.jsonl"], "no_prompt.jsonl: 1 of 2 row(s) unusable — line 2 has no 'prompt' "
                                       "(columns: question, answer)"),
    (["--prompts", "not_text.jsonl"], "line 2: 'prompt' must be text or a non-empty list of chat messages"),
    (["--prompts", "long.jsonl"], "long.jsonl: 1 of 2 prompt(s) are longer than the plan's prompt_len 16 tokens "
                                  "(row 2: 40 tokens, 'add 1+1: xxx"),
    (["--prompts", "long.jsonl", "--prompt-len", "8"], "2 of 2 prompt(s) are longer than the plan's prompt_len 8"),
    (["--prompts", "no_answer.jsonl"], "reward.py:last_number' needs the column 'answer', which 1 of 2 row(s) of "
                                       "no_answer.jsonl lack (row 2 first"),
    (["--prompts", "no_answer.jsonl", "--reward-function", "reward.py:needs_first"],
     "reward function 'reward.py:needs_first' raised KeyError 'answer' on row 2 of no_answer.jsonl"),
    (["--prompts", "good.jsonl", "--reward-function", "reward.py:boom"],
     "reward function 'reward.py:boom' raised ZeroDivisionError (float division by zero) at "),
    (["--prompts", "good.jsonl", "--reward-function", "rewards.py:last_number"], "no file rewards.py"),
    (["--prompts", "good.jsonl", "--reward-function", "reward.py:last_numbr"],
     "module 'reward.py' has no 'last_numbr' (its functions: last_number, needs_first, boom)"),
    (["--prompts", "good.jsonl", "--eval-every", "2"], "--eval-every 2: no held-out prompts"),
    (["--temperature", "-1", "--top-p", "2", "--warmup-steps", "-3", "--lr-schedule", "wavy"],
     "run config: 4 bad field(s) — 'sampling.temperature': "),
    (["--set", "optimizer.warmup_steps=5", "--set", "optimizer.schedule=cosine"],
     "'optimizer.warmup_steps': unknown field; it goes under optimizer.actor.warmup_steps or "
     "optimizer.critic.warmup_steps; 'optimizer.schedule': unknown field"),
    (["--response-len", "0"], "the plan with --response-len: field 'workload.response_len'"),
    (["--resume", "--checkpoint-dir", ".", "--more", "2"], "nothing to resume"),
    (["--more", "2"], "--more counts iterations after a checkpoint; add --resume"),
])
def test_each_late_failure_is_one_line_before_torch_or_ray(task, argv, message):
    rc, err, seconds = _hflow(task, "run", "plan.json", "--iterations", "1", *argv)
    assert rc == 2, (rc, err)  # 9 would mean torch or ray was imported first
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert seconds < 15, seconds  # about 1 s on a quiet machine; the bound leaves room for a busy CI box


def test_debug_shows_the_user_code_traceback(task):
    rc, err, _ = _hflow(task, "run", "plan.json", "--prompts", "good.jsonl", "--reward-function", "reward.py:boom",
                        "--debug")
    assert rc == 2
    assert "Traceback" in err and 'reward.py", line 15, in boom' in err, err
    assert err.splitlines()[-1].startswith("hflow-plan: error: reward function 'reward.py:boom' raised")


def test_search_refuses_a_reward_it_cannot_import_and_writes_no_plan(task):
    base = ["search", "--profile", "cpu-2core", "--gpus-per-node", "2", "--model", "tiny", "--algo", "grpo",
            "--samples", "4", "--batch", "8", "--prompt-len", "16", "--response-len", "8", "--out", "typo.json"]
    for ref, message in [("reward.py:last_numbr", "has no 'last_numbr'"), ("rewrd.py:last_number", "no file rewrd.py")]:
        rc, err, _ = _hflow(task, *base, "--reward-function", ref)
        assert rc == 2 and message in err and len(err.splitlines()) == 1, err
        assert not (task / "typo.json").exists()
    one = [a if a != "4" else "1" for a in base]  # --samples 1
    rc, err, _ = _hflow(task, *one, "--reward-function", "reward.py:last_number")
    assert rc == 2 and "--samples 1: grpo compares the samples of each prompt" in err, err


def test_overlong_prompts_cut_or_dropped_as_asked(task):
    from hybridflow.runtime.rl.resolve import resolve_run
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.simulator.vocabulary.plan import Plan
    from hybridflow.tools.preflight.inputs import check_inputs

    plan = Plan.load(task / "plan.json")
    for policy, rows, message in [("drop", 1, "1 over it dropped"), ("truncate-left", 2, "1 over it truncated on the left")]:
        cfg = resolve_run(plan, RunConfig(data={"prompts_file": str(task / "long.jsonl"), "overlong": policy})).config
        report = check_inputs(plan, cfg)
        assert report.rows == rows and report.longest == 40 and report.overlong == 1
        assert message in report.line(16, policy)
    only_long = task / "only_long.jsonl"
    only_long.write_text(json.dumps({"prompt": "x" * 30, "answer": "1"}) + "\n")
    cfg = resolve_run(plan, RunConfig(data={"prompts_file": str(only_long), "overlong": "drop"})).config
    with pytest.raises(HflowError, match="every prompt is longer than prompt_len 16 tokens, so --drop-overlong leaves none"):
        check_inputs(plan, cfg)


def test_token_counts_match_the_runs_tokenizer(tmp_path):
    """The torch-free count is the run's: text with the tokenizer's special tokens, chat messages (a system role
    too) and plain text through the chat template, on a BPE tokenizer with a ChatML template."""
    from hf_util import build_hf_folder

    from hybridflow.runtime.tasks.model_tokenizer import load_tokenizer
    from hybridflow.runtime.tasks.token_count import has_chat_template, prompt_counter

    folder = build_hf_folder(tmp_path / "m")
    count, tok = prompt_counter(folder), load_tokenizer(folder)
    assert has_chat_template(folder)
    prompts = ["what is 2 plus 3?", "", [{"role": "system", "content": "answer with a number"},
                                         {"role": "user", "content": "what is 12 plus 30?"}]]
    for p in prompts:
        for chat in (False, True):
            assert count(p, chat) == len(tok.encode_prompt(p, chat)), (p, chat)


def test_plain_text_goes_through_the_actor_folders_chat_template_unless_turned_off(tmp_path):
    from hf_util import build_hf_folder

    from hybridflow.runtime.rl.resolve import resolve_run
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.simulator.vocabulary.model import ModelSpec

    def chat(folder, cfg=None) -> bool:
        plan = tiny_plan("grpo", [["actor", "ref"]], model=ModelSpec.from_hf_config(folder), paths={"actor": str(folder)})
        return resolve_run(plan, cfg).config.data.chat_template

    with_template = build_hf_folder(tmp_path / "chat")
    without = build_hf_folder(tmp_path / "plain", chat_template=False)
    assert chat(with_template) is True  # the default: the folder has one
    assert chat(with_template, RunConfig(data={"chat_template": False})) is False  # --no-chat-template
    assert chat(without) is False
    assert resolve_run(tiny_plan("grpo", [["actor", "ref"]])).config.data.chat_template is False  # character tokenizer
