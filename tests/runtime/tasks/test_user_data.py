"""The user's data and reward: prompts (text or chat messages) from JSONL, Parquet and a `datasets` folder
with extra columns; a reward that raises or returns NaN / inf / a non-number, and a score model's
non-finite scores, are one line naming the function, the sample, its data row and the value."""

import json

import pytest
import torch

from hybridflow.runtime.tasks.data import PromptDataset, check_prompt
from hybridflow.runtime.tasks.rewards import check_finite_scores, score_responses
from hybridflow.simulator.errors import HflowError

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 plus 3?"}]
ROWS = [{"prompt": CHAT, "answer": "5", "level": 1}, {"prompt": "what is 1 plus 1?", "answer": "2", "level": 2}]


def _same_rows(ds: PromptDataset) -> None:
    prompts, cols = ds.take([0, 1])
    assert prompts == [CHAT, "what is 1 plus 1?"]
    assert cols == {"answer": ["5", "2"], "level": [1, 2]}
    assert ds.has_chat()


def test_prompts_text_and_chat_from_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    _same_rows(PromptDataset.from_file(f))


def test_prompts_chat_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # an Arrow column holds one type: chat messages in one file, text in another
    pq.write_table(pa.Table.from_pylist([ROWS[0], {**ROWS[0], "answer": "6"}]), tmp_path / "chat.parquet")
    ds = PromptDataset.from_file(tmp_path / "chat.parquet")
    assert ds.take([1]) == ([CHAT], {"answer": ["6"], "level": [1]})


def test_prompts_from_a_saved_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets", reason="`datasets` folders need the datasets library")
    chat_rows = [ROWS[0], {**ROWS[0], "answer": "6", "level": 2}]
    datasets.Dataset.from_list(chat_rows).save_to_disk(str(tmp_path / "ds"))
    ds = PromptDataset.from_file(tmp_path / "ds")
    assert ds.take([0, 1]) == ([CHAT, CHAT], {"answer": ["5", "6"], "level": [1, 2]})
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[1:]),
                          "test": datasets.Dataset.from_list(ROWS[1:] * 2)}).save_to_disk(str(tmp_path / "dd"))
    assert len(PromptDataset.from_file(tmp_path / "dd")) == 1  # the train split
    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS[1:]),
                          "b": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(HflowError, match="splits a, b; give the folder of one split"):
        PromptDataset.from_file(tmp_path / "ab")
    assert len(PromptDataset.from_file(tmp_path / "ab" / "b")) == 1
    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "nop"))
    with pytest.raises(HflowError, match="no 'prompt' column \\(columns: text\\)"):
        PromptDataset.from_file(tmp_path / "nop")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HflowError, match="not a folder written by datasets' save_to_disk") as e:
        PromptDataset.from_file(tmp_path / "empty")
    assert "\n" not in str(e.value)


def test_bad_prompts_are_one_line(tmp_path):
    for bad in (3, [], [{"role": "user"}], [{"role": "user", "content": 7}], ["hi"]):
        with pytest.raises(HflowError, match="'prompt' must be text or a non-empty list of chat messages"):
            check_prompt(bad, "row 1")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n[1, 2]\n')
    with pytest.raises(HflowError, match="line 2 is a JSON list, not an object"):
        PromptDataset.from_file(f)
    f.write_text('{"prompt": "ok"}\n{"prompt": {"role": "user"}}\n')
    with pytest.raises(HflowError, match=f"{f}: 1 of 2 row\\(s\\) unusable — line 2: 'prompt' must be text"):
        PromptDataset.from_file(f)


def _bad(prompt, response, mode=None, **_):
    if mode == "raise":
        raise ZeroDivisionError("division by zero")
    return {"nan": float("nan"), "inf": float("inf"), "text": "1.0", "none": None}.get(mode, 0.5)


@pytest.mark.parametrize("mode, msg", [
    ("raise", "f 'r.py:bad' raised ZeroDivisionError \\(division by zero\\) on sample 1 \\(row 8 of data.jsonl, "
              "prompt 'what is 2 plus 3\\?'\\), response 'abc'; fix the function"),
    ("nan", "f 'r.py:bad' returned nan for sample 1 \\(row 8 of data.jsonl, .*\\); it must return a finite number"),
    ("inf", "returned inf for sample 1 .*; it must return a finite number"),
    ("text", "returned '1.0' for sample 1 .*; it must return a number"),
    ("none", "returned 'None' for sample 1 .*; it must return a number"),
])
def test_reward_failures_name_the_function_sample_row_and_value(mode, msg):
    with pytest.raises(HflowError, match=msg) as e:
        score_responses(_bad, ["p", CHAT], ["x", "abc"], {"mode": [None, mode]}, name="f 'r.py:bad'",
                        rows=[3, 7], source="data.jsonl")
    assert "\n" not in str(e.value)
    ok = score_responses(_bad, ["p"], ["x"], {"mode": [None]})
    assert ok.tolist() == [0.5]
    assert score_responses(lambda p, r: True, ["p"], ["x"]).tolist() == [1.0]  # a bool is a number


def test_score_model_non_finite_scores_are_one_line():
    check_finite_scores(torch.tensor([0.1, -2.0]), "reward model m", ["a", "b"])
    with pytest.raises(HflowError, match="reward model m scored nan for sample 1 \\(row 5 of d, prompt 'b'\\); "
                                         "a score model must give finite scores"):
        check_finite_scores(torch.tensor([0.1, float("nan")]), "reward model m", ["a", "b"], rows=[0, 4], source="d")
