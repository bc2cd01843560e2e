"""Built-in tasks: tokenizer, rule-based rewards, datasets, user prompt files, reward functions, warm-up."""

import json

import pytest
import torch

from hybridflow.runtime.tasks.builtin import TASKS, add_reward, get_task, positional_credit, sort_reward
from hybridflow.runtime.tasks.data import PromptDataset, PromptSampler
from hybridflow.runtime.tasks.rewards import load_function, score_responses
from hybridflow.runtime.tasks.tokenizer import CharTokenizer
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import model_preset


def test_tokenizer_fits_tiny_preset_and_round_trips():
    tok = CharTokenizer()
    assert tok.vocab_size <= model_preset("tiny").vocab == 64
    text = "sort 4137: add 27+58!"
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == text
    assert tok.decode(tok.encode("Sort")) == "sort"  # upper case folds
    assert tok.encode("é") == [tok.unk_id]
    with pytest.raises(HflowError, match="'é' .* not in the tokenizer's vocabulary"):
        tok.encode("café", strict=True)
    assert tok.decode([5, 6, tok.eos_id, 7]) == "12"


def test_prompts_are_left_padded():
    tok = CharTokenizer()
    ids, mask = tok.encode_prompts(["ab", "abcd"])
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert ids[0, :2].tolist() == [tok.pad_id] * 2 and ids[0, 2].item() == tok.bos_id
    assert ids.shape == (2, 5)
    assert tok.encode_prompts(["ab"], max_len=8)[0].shape == (1, 3)  # a bound, not a width
    with pytest.raises(HflowError, match="prompt has 5 tokens but prompt_len is 4 \\('abcd'\\)"):
        tok.encode_prompts(["abcd"], max_len=4)


def test_sort_reward_partial_credit_by_hand():
    p = "sort 4137:"
    assert sort_reward(p, "1347", answer="1347") == 1.0
    assert sort_reward(p, "1374", answer="1347") == 0.5  # 2 of 4 places
    assert sort_reward(p, "13470", answer="1347") == 0.8  # 4 of max(5, 4)
    assert sort_reward(p, "") == 0.0
    assert sort_reward(p, "1347") == 1.0  # answer recomputed from the prompt
    assert sort_reward("sort 90:", "09") == 1.0


def test_add_reward_counts_digits_from_the_right():
    assert add_reward("add 27+58:", "85") == 1.0
    assert add_reward("add 27+58:", "75") == 0.5
    assert add_reward("add 27+58:", "5") == 0.5
    assert add_reward("add 99+1:", "100") == 1.0
    assert positional_credit("", "") == 1.0


def test_task_examples_are_their_own_answers():
    import random

    for t in TASKS.values():
        rng = random.Random(0)
        for _ in range(50):
            ex = t.make_example(rng)
            assert t.reward(ex["prompt"], ex["answer"]) == 1.0
            assert len(ex["prompt"]) <= t.max_prompt_chars and len(ex["answer"]) <= t.max_answer_chars
    with pytest.raises(HflowError, match="unknown task 'chess'; built-in tasks: sort, add"):
        get_task("chess")


def test_task_dataset_is_seeded():
    a, b = PromptDataset.from_task("sort", 20, seed=1), PromptDataset.from_task("sort", 20, seed=1)
    assert a.rows == b.rows
    assert a.rows != PromptDataset.from_task("sort", 20, seed=2).rows
    prompts, cols = a.take([3, 0])
    assert prompts == [a[3]["prompt"], a[0]["prompt"]] and cols["answer"] == [a[3]["answer"], a[0]["answer"]]


def test_prompts_from_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "sort 21:", "answer": "12"}\n\n{"prompt": "sort 3:", "level": 2}\n')
    ds = PromptDataset.from_file(f)
    assert len(ds) == 2
    prompts, cols = ds.take([0, 1])
    assert cols == {"answer": ["12", None], "level": [None, 2]}
    f.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(HflowError, match="line 2 is not JSON"):
        PromptDataset.from_file(f)
    f.write_text('{"question": "x"}\n')
    with pytest.raises(HflowError, match="line 1 has no 'prompt' \\(columns: question\\)"):
        PromptDataset.from_file(f)
    with pytest.raises(HflowError, match="no such prompt file or folder"):
        PromptDataset.from_file(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt\n")
    with pytest.raises(HflowError, match="unknown prompt file type '.csv'"):
        PromptDataset.from_file(tmp_path / "p.csv")


def test_prompts_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet prompt files need pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["sort 21:", "sort 3:"], "answer": ["12", "3"]}), tmp_path / "p.parquet")
    ds = PromptDataset.from_file(tmp_path / "p.parquet")
    assert ds.rows == [{"prompt": "sort 21:", "answer": "12"}, {"prompt": "sort 3:", "answer": "3"}]
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "q.parquet")
    with pytest.raises(HflowError, match="no 'prompt' column"):
        PromptDataset.from_file(tmp_path / "q.parquet")


def test_reward_function_by_name(tmp_path):
    assert load_function(get_task("sort").reward_function) is sort_reward
    user = tmp_path / "my_reward.py"
    user.write_text("def length(prompt, response, **kw):\n    return len(response) / 10\n"
                    "def bad(prompt, response, **kw):\n    return 'yes'\nNOT_CALLABLE = 3\n")
    fn = load_function(f"{user}:length")
    assert score_responses(fn, ["a", "b"], ["xy", ""]).tolist() == pytest.approx([0.2, 0.0])
    for ref, msg in [("no_colon", "must be written 'module:function'"),
                     ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                     ("hybridflow.runtime.tasks.builtin:nope", "has no 'nope'"),
                     (f"{user}:NOT_CALLABLE", "is not callable"),
                     (f"{tmp_path}/absent.py:f", "no file")]:
        with pytest.raises(HflowError, match=msg) as e:
            load_function(ref)
        assert "\n" not in str(e.value)
    with pytest.raises(HflowError, match="returned 'yes' for sample 0 \\(prompt 'a'\\); it must return a number"):
        score_responses(load_function(f"{user}:bad"), ["a"], ["b"])


def test_scores_pass_row_fields_to_the_reward():
    got = score_responses(sort_reward, ["sort 31:", "sort 31:"], ["13", "31"], {"answer": ["13", None]})
    assert got.tolist() == [1.0, 0.0]


def test_sampler_covers_each_epoch_and_resumes_exactly():
    s = PromptSampler(10, 4, seed=3)
    drawn = [s.next_indices() for _ in range(5)]  # 20 indices = 2 epochs
    flat = [i for b in drawn for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a new permutation each epoch
    again = PromptSampler(10, 4, seed=3)
    again.next_indices(), again.next_indices()
    resumed = PromptSampler(10, 4, seed=3)
    resumed.load_state_dict(again.state_dict())
    assert [resumed.next_indices() for _ in range(3)] == drawn[2:]
    with pytest.raises(HflowError, match="resume with the same data"):
        PromptSampler(11, 4, seed=3).load_state_dict(again.state_dict())


def test_warmup_builds_once_and_policy_sometimes_succeeds(tmp_path):
    from hybridflow.runtime.models.hf_format import load_pretrained
    from hybridflow.runtime.tasks.warmup import (
        WarmupConfig,
        greedy_accuracy,
        sft_batch,
        warm_policy,
        warmup_metrics,
    )

    torch.set_num_threads(1)
    spec = model_preset("tiny").model_copy(update={"name": "tiny2", "layers": 2})
    from hybridflow.runtime.tasks.policy_cache import cached_policy, measured_rate, step_flops, warmup_cost

    cfg = WarmupConfig(max_steps=120, target_greedy_accuracy=0.1, eval_size=128)
    assert cached_policy(spec, cfg, tmp_path) is None and measured_rate(tmp_path) is None
    assert not warmup_cost(spec, cfg, tmp_path).measured  # the first guess's rate
    steps: list[tuple[int, int]] = []
    folder = warm_policy(spec, cfg, root=tmp_path, on_step=lambda step, total: steps.append((step, total)))
    metrics = warmup_metrics(folder)
    assert metrics["greedy_accuracy"] >= 0.1 and metrics["steps"] <= 120
    assert steps == [(i, 120) for i in range(1, metrics["steps"] + 1)]  # the progress bar's ticks
    assert cached_policy(spec, cfg, tmp_path) == folder
    # the build's own rate estimates the next warm-up here
    assert metrics["flops"] == step_flops(spec, cfg) * metrics["steps"] and metrics["seconds"] > 0
    assert measured_rate(tmp_path) == metrics["flops"] / metrics["seconds"]
    assert warmup_cost(spec, cfg, tmp_path).measured
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert warm_policy(spec, cfg, root=tmp_path) == folder  # reused, not rebuilt
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    model = load_pretrained(folder)
    tok = CharTokenizer.load(folder)
    import random

    rng = random.Random(99)
    fresh = sft_batch([get_task("sort").make_example(rng) for _ in range(128)], tok)
    assert greedy_accuracy(model, fresh) > 0.03  # succeeds sometimes on prompts it never saw
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 64
