"""The user's prompt files read and checked row by row, torch-free (so `run` checks them before torch or Ray
load): a JSONL file, a Parquet file, or a folder written by `datasets`' `save_to_disk` (a `Dataset`, or a
split of a `DatasetDict`: `train` for training, `test` / `validation` for evaluation).

Every row is checked at once — JSON, a `prompt` field, text or chat messages — and the problems are
reported in one line: how many rows are bad and the first few of them, each with what is wrong.

    rows = read_prompt_rows("data/questions.jsonl")             # [{"prompt": ..., "answer": ...}, ...]
    rows = read_prompt_rows("data/gsm", split="test")            # a DatasetDict's held-out split
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import read_text_file

Message = dict[str, str]
Prompt = str | list[Message]
FORMATS = "a .jsonl or .parquet file or a `datasets` folder (save_to_disk)"
EVAL_SPLITS = ("test", "validation")  # a DatasetDict's held-out splits, in the order they are looked for
SHOWN = 3  # bad rows named in the one-line error


def is_chat(prompt: Prompt) -> bool:
    return not isinstance(prompt, str)


def prompt_preview(prompt: Prompt, width: int = 60) -> str:
    """One short line for messages and logs: the text, or the last chat message's content."""
    text = prompt if isinstance(prompt, str) else (prompt[-1]["content"] if prompt else "")
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def prompt_problem(value: Any) -> str | None:
    """What is wrong with `value` as a prompt (None: text, or a non-empty list of chat messages with
    text roles and contents)."""
    if isinstance(value, str):
        return None
    if (isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value)
            and all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)):
        return None
    return ("'prompt' must be text or a non-empty list of chat messages ({\"role\": ..., \"content\": ...}), "
            f"not {str(value)[:60]!r}")


def check_prompt(value: Any, where: str) -> Prompt:
    """`value` as a Prompt (chat messages keep their non-null fields); one-line error otherwise."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        value = [{k: v for k, v in m.items() if v is not None} for m in value]
    problem = prompt_problem(value)
    if problem:
        raise HflowError(f"{where}: {problem}")
    return value


def _bad_rows(source: str, problems: list[str], total: int) -> HflowError:
    shown = "; ".join(problems[:SHOWN]) + ("; …" if len(problems) > SHOWN else "")
    return HflowError(f"{source}: {len(problems)} of {total} row(s) unusable — {shown}; fix those rows (every row is "
                      "one JSON object with a 'prompt': text or chat messages)")


def check_rows(rows: list[Any], source: str, label: str = "row") -> list[dict]:
    """Every row a dict with a usable `prompt` (chat messages cleaned of null fields); one line naming
    the bad rows otherwise. `label` names a row's place ("line" for a JSONL file)."""
    problems, out = [], []
    for n, row in enumerate(rows, 1):
        if isinstance(row, str):  # a JSONL line that did not parse (read_jsonl_rows)
            problems.append(f"{label} {n} is not JSON")
            continue
        if not isinstance(row, dict):
            problems.append(f"{label} {n} is a JSON {type(row).__name__}, not an object")
            continue
        if "prompt" not in row:
            problems.append(f"{label} {n} has no 'prompt' (columns: {', '.join(row) or 'none'})")
            continue
        value = row["prompt"]
        if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
            value = [{k: v for k, v in m.items() if v is not None} for m in value]
        problem = prompt_problem(value)
        if problem:
            problems.append(f"{label} {n}: {problem}")
            continue
        out.append({**row, "prompt": value})
    if problems:
        raise _bad_rows(source, problems, len(rows))
    if not out:
        raise HflowError(f"{source}: no prompts; give at least one row with a 'prompt'")
    return out


def _read_jsonl(p: Path) -> list[Any]:
    """Each non-blank line parsed (a line that is not JSON kept as its text, for check_rows to name)."""
    rows: list[Any] = []
    for line in read_text_file(p, "a prompt file").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append(line)
    return rows


def read_prompt_rows(path: str | Path, split: str | None = None) -> list[dict]:
    """The rows of a prompt file or `datasets` folder, every one checked. `split`: which split of a
    DatasetDict (default `train`, or its only split)."""
    p = Path(path)
    if p.is_dir():
        return check_rows(_read_saved_dataset(p, split), str(p))
    if not p.is_file():
        raise HflowError(f"{p}: no such prompt file or folder; give {FORMATS} with a 'prompt' column")
    if p.suffix.lower() in (".jsonl", ".json"):
        return check_rows(_read_jsonl(p), str(p), "line")
    if p.suffix.lower() == ".parquet":
        return check_rows(_read_parquet(p), str(p))
    raise HflowError(f"{p}: unknown prompt file type '{p.suffix}'; give {FORMATS}")


def _read_parquet(p: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HflowError(f"{p}: reading Parquet needs pyarrow; `pip install pyarrow` or convert to JSONL") from None
    try:
        table = pq.read_table(p)
    except Exception as e:
        raise HflowError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    if "prompt" not in table.column_names:
        raise HflowError(f"{p}: no 'prompt' column (columns: {', '.join(table.column_names)})")
    return table.to_pylist()


def _load_from_disk(p: Path):
    try:
        import datasets
    except ImportError:
        raise HflowError(f"{p}: reading a `datasets` folder needs the datasets library; "
                         "`pip install datasets` or give a .jsonl / .parquet file") from None
    try:
        return datasets, datasets.load_from_disk(str(p))
    except Exception as e:  # FileNotFoundError for a folder save_to_disk did not write, or a damaged one
        raise HflowError(f"{p}: not a folder written by datasets' save_to_disk "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def dataset_splits(path: str | Path) -> list[str]:
    """The splits of a DatasetDict folder ([] for anything else)."""
    p = Path(path)
    if not (p / "dataset_dict.json").is_file():
        return []
    try:
        return list(json.loads((p / "dataset_dict.json").read_text()).get("splits", []))
    except (OSError, ValueError):
        return []


def held_out_split(path: str | Path) -> str | None:
    """The held-out split a DatasetDict folder carries (`test`, else `validation`), or None."""
    splits = dataset_splits(path)
    return next((s for s in EVAL_SPLITS if s in splits), None)


def _read_saved_dataset(p: Path, split: str | None) -> list[dict]:
    """A `Dataset`, or a split of a `DatasetDict` (`split`; default `train`, or its only split)."""
    datasets, ds = _load_from_disk(p)
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is not None:
            if split not in splits:
                raise HflowError(f"{p}: no split '{split}' (splits: {', '.join(splits)})")
            ds = ds[split]
        else:
            if len(splits) != 1 and "train" not in splits:
                raise HflowError(f"{p}: a DatasetDict with splits {', '.join(splits)}; give the folder of one "
                                 f"split ({p}/{splits[0]}) or name one 'train'")
            ds = ds["train" if "train" in splits else splits[0]]
    elif split not in (None, "train"):
        raise HflowError(f"{p}: a single Dataset, not a DatasetDict with a '{split}' split")
    if "prompt" not in ds.column_names:
        raise HflowError(f"{p}: no 'prompt' column (columns: {', '.join(ds.column_names)})")
    return ds.to_list()


def task_rows(task: str, size: int, seed: int = 0) -> list[dict]:
    """`size` rows of a built-in task, deterministic for (task, seed)."""
    from hybridflow.runtime.tasks.builtin import get_task

    rng = random.Random(f"{task}:{seed}")  # str seeds are hashed deterministically (not PYTHONHASHSEED)
    t = get_task(task)
    return [t.make_example(rng) for _ in range(size)]


def held_out_source(eval_file: str | None, train_file: str | None) -> tuple[str | None, str | None]:
    """(the held-out set's path, its split): `eval_file` (a DatasetDict's test or validation split), else the
    test / validation split of the training prompts' DatasetDict; (None, None) without either."""
    if eval_file:
        return eval_file, held_out_split(eval_file)
    if train_file and (split := held_out_split(train_file)):
        return train_file, split
    return None, None
