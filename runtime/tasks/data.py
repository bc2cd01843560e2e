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

from pathlib import Path

import torch

from hybridflow.runtime.tasks.prompt_files import (  # noqa: F401  (re-exported: the readers and checks are torch-free)
    FORMATS,
    Message,
    Prompt,
    check_prompt,
    is_chat,
    prompt_preview,
    read_prompt_rows,
    task_rows,
)
from hybridflow.simulator.errors import HflowError


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
        return cls(task_rows(task, size, seed), source=f"task {task} (seed {seed})")

    @classmethod
    def from_file(cls, path: str | Path, split: str | None = None) -> PromptDataset:
        """The user's prompts: a JSONL or Parquet file, or a folder written by `Dataset.save_to_disk`
        (`split` of a DatasetDict; default `train`), every row checked (tasks/prompt_files.py)."""
        return cls(read_prompt_rows(path, split), source=str(path) + (f" ({split})" if split else ""))

    def only(self, keep: list[int]) -> PromptDataset:
        """The rows at `keep` (the prompts a run keeps after dropping over-long ones)."""
        return PromptDataset([self.rows[i] for i in keep], self.source)


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
