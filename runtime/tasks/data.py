"""Prompt datasets and a resumable sampler.

A dataset is a list of rows, each a dict with a `prompt` and any other columns (`answer`,
`data_source`, …) that are passed on to the reward function. A prompt is text or a list of chat
messages (`[{"role": "user", "content": …}]`, rendered by the tokenizer's chat template). Rows come
from a built-in task (deterministic for a seed) or from the user's data: a JSONL file, a Parquet
file, or a folder written by `datasets`' `save_to_disk` — one reader per format. The sampler draws
batches in a per-epoch permutation fixed by (seed, epoch); its state is two integers, so a resumed
run sees exactly the prompts a straight run would.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import read_jsonl

Message = dict[str, str]
Prompt = str | list[Message]
FORMATS = "a .jsonl or .parquet file or a `datasets` folder (save_to_disk)"


def is_chat(prompt: Prompt) -> bool:
    return not isinstance(prompt, str)


def prompt_preview(prompt: Prompt, width: int = 60) -> str:
    """One short line for messages and logs: the text, or the last chat message's content."""
    text = prompt if isinstance(prompt, str) else (prompt[-1]["content"] if prompt else "")
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def check_prompt(value: Any, where: str) -> Prompt:
    """`value` as a Prompt (chat messages keep their non-null fields); one-line error otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        messages = [{k: v for k, v in m.items() if v is not None} for m in value]
        if all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            return messages
    raise HflowError(f"{where}: 'prompt' must be text or a non-empty list of chat messages "
                     f"({{\"role\": ..., \"content\": ...}}), not {str(value)[:60]!r}")


class PromptDataset:
    def __init__(self, rows: list[dict], source: str = ""):
        if not rows:
            raise HflowError(f"{source or 'prompt dataset'}: no prompts; give at least one row with a 'prompt'")
        self.rows = rows
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def columns(self) -> list[str]:
        return sorted({k for r in self.rows for k in r})

    def has_chat(self) -> bool:
        return any(is_chat(r["prompt"]) for r in self.rows)

    def take(self, indices: list[int]) -> tuple[list[Prompt], dict[str, list]]:
        """(prompts, other columns as lists aligned with the prompts; missing values are None)."""
        rows = [self.rows[i] for i in indices]
        cols = [c for c in self.columns() if c != "prompt"]
        return [r["prompt"] for r in rows], {c: [r.get(c) for r in rows] for c in cols}

    @classmethod
    def from_task(cls, task: str, size: int, seed: int = 0) -> PromptDataset:
        rng = random.Random(f"{task}:{seed}")  # str seeds are hashed deterministically (not PYTHONHASHSEED)
        t = get_task(task)
        return cls([t.make_example(rng) for _ in range(size)], source=f"task {task} (seed {seed})")

    @classmethod
    def from_file(cls, path: str | Path) -> PromptDataset:
        """The user's prompts: a JSONL or Parquet file, or a folder written by `Dataset.save_to_disk`."""
        p = Path(path)
        if p.is_dir():
            rows = _read_saved_dataset(p)
        elif not p.is_file():
            raise HflowError(f"{p}: no such prompt file or folder; give {FORMATS} with a 'prompt' column")
        elif p.suffix in (".jsonl", ".json"):
            rows = read_jsonl(p, "a prompt file")
        elif p.suffix == ".parquet":
            rows = _read_parquet(p)
        else:
            raise HflowError(f"{p}: unknown prompt file type '{p.suffix}'; give {FORMATS}")
        for i, r in enumerate(rows):
            if "prompt" not in r:
                raise HflowError(f"{p}: row {i + 1} has no 'prompt' field; every row needs one "
                                 f"(columns: {', '.join(r) or 'none'})")
            r["prompt"] = check_prompt(r["prompt"], f"{p}: row {i + 1}")
        return cls(rows, source=str(p))


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


def _read_saved_dataset(p: Path) -> list[dict]:
    """A `Dataset` (or the `train` split, or the only split, of a `DatasetDict`) saved with save_to_disk."""
    try:
        import datasets
    except ImportError:
        raise HflowError(f"{p}: reading a `datasets` folder needs the datasets library; "
                         "`pip install datasets` or give a .jsonl / .parquet file") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # FileNotFoundError for a folder save_to_disk did not write, or a damaged one
        raise HflowError(f"{p}: not a folder written by datasets' save_to_disk "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) != 1 and "train" not in splits:
            raise HflowError(f"{p}: a DatasetDict with splits {', '.join(splits)}; give the folder of one "
                             f"split ({p}/{splits[0]}) or name one 'train'")
        ds = ds["train" if "train" in splits else splits[0]]
    if "prompt" not in ds.column_names:
        raise HflowError(f"{p}: no 'prompt' column (columns: {', '.join(ds.column_names)})")
    return ds.to_list()


class PromptSampler:
    """Batches of dataset indices: a fresh permutation each epoch from (seed, epoch); no prompt repeats
    within an epoch, and a batch that crosses an epoch boundary continues into the next permutation."""

    def __init__(self, size: int, batch_size: int, seed: int = 0):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.cursor = 0, 0
        self.replay, self.skip = 0, 0  # after a resume: draw `replay` indices, then jump over `skip`

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def _advance(self, n: int) -> tuple[int, int]:
        """(epoch, cursor) `n` indices on (back, for n < 0)."""
        epoch, cursor = divmod(self.epoch * self.size + self.cursor + n, self.size)
        if epoch < 0:
            raise ValueError(f"cannot rewind {-n} indices past the first one")
        return epoch, cursor

    def next_indices(self, count: int | None = None) -> list[int]:
        """The next `count` indices (default: a batch)."""
        count = self.batch_size if count is None else count
        out: list[int] = []
        while len(out) < count:
            if self.skip and not self.replay:
                (self.epoch, self.cursor), self.skip = self._advance(self.skip), 0
            order = self._order(self.epoch)
            take = min(count - len(out), self.size - self.cursor, self.replay if self.skip else count)
            out += order[self.cursor:self.cursor + take]
            self.cursor += take
            self.replay -= take if self.skip else 0
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state_dict(self, rewind: int = 0, skip: int = 0) -> dict[str, int]:
        """`rewind`: the state from before the last `rewind` indices were drawn (prompts drawn but not yet
        trained on, such as a one-step-off rollout in flight, are drawn again after a resume); `skip`: of
        those, the last `skip` were trained already (a dynamic-sampling round's prompts, drawn after a
        rollout in flight): a resumed run draws the others, then jumps over them."""
        if self.skip:  # a resume's jump not made yet: the state it resumed from, moved on by what was drawn since
            raise ValueError("cannot save a sampler between a resume and its first draws")
        epoch, cursor = self._advance(-rewind)
        return {"epoch": epoch, "cursor": cursor, "replay": rewind - skip, "skip": skip, "seed": self.seed,
                "size": self.size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if (state["size"], state["seed"]) != (self.size, self.seed):
            raise HflowError(f"checkpoint was written for a dataset of {state['size']} prompts with seed "
                             f"{state['seed']}, not {self.size} with seed {self.seed}; resume with the same data")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.replay, self.skip = state.get("replay", 0), state.get("skip", 0)  # absent in older checkpoints
