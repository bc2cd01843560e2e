"""Prompt datasets and a resumable sampler.

A dataset is a list of rows, each a dict with a string `prompt` and any other columns (`answer`,
`data_source`, …) that are passed on to the reward function. Rows come from a built-in task
(deterministic for a seed) or from the user's JSONL / Parquet file. The sampler draws batches in
a per-epoch permutation fixed by (seed, epoch); its state is two integers, so a resumed run sees
exactly the prompts a straight run would.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from hybridflow.simulator.errors import HflowError

from .builtin import get_task


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

    def take(self, indices: list[int]) -> tuple[list[str], dict[str, list]]:
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
        p = Path(path)
        if not p.is_file():
            raise HflowError(f"{p}: no such prompt file; give a .jsonl or .parquet file with a 'prompt' column")
        if p.suffix in (".jsonl", ".json"):
            rows = _read_jsonl(p)
        elif p.suffix == ".parquet":
            rows = _read_parquet(p)
        else:
            raise HflowError(f"{p}: unknown prompt file type '{p.suffix}'; use .jsonl or .parquet")
        for i, r in enumerate(rows):
            if not isinstance(r.get("prompt"), str):
                raise HflowError(f"{p}: row {i + 1} has no string 'prompt' field; every row needs one")
        return cls(rows, source=str(p))


def _read_jsonl(p: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise HflowError(f"{p}: line {n} is not valid JSON; write one JSON object per line") from None
        if not isinstance(row, dict):
            raise HflowError(f"{p}: line {n} is a {type(row).__name__}, not an object with a 'prompt' field")
        rows.append(row)
    return rows


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


class PromptSampler:
    """Batches of dataset indices: a fresh permutation each epoch from (seed, epoch); no prompt repeats
    within an epoch, and a batch that crosses an epoch boundary continues into the next permutation."""

    def __init__(self, size: int, batch_size: int, seed: int = 0):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.cursor = 0, 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_indices(self, count: int | None = None) -> list[int]:
        """The next `count` indices (default: a batch)."""
        count = self.batch_size if count is None else count
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.epoch)
            take = min(count - len(out), self.size - self.cursor)
            out += order[self.cursor:self.cursor + take]
            self.cursor += take
            if self.cursor == self.size:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": self.size,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if (state["size"], state["seed"]) != (self.size, self.seed):
            raise HflowError(f"checkpoint was written for a dataset of {state['size']} prompts with seed "
                             f"{state['seed']}, not {self.size} with seed {self.seed}; resume with the same data")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
