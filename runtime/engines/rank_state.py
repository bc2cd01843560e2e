"""A training checkpoint's per-rank part: the optimizer step and the random-number states.

Both training engines (FSDP2 and Megatron) save it beside their sharded model and optimizer states, so
that a resumed run draws the same random numbers as a straight one.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import torch

from hybridflow.simulator.io import write_atomic


def rank_state_file(path: Path, rank: int) -> Path:
    return path / f"extra_rank{rank}.pt"


def save_rank_state(path: Path, rank: int, step: int) -> None:
    state = {"step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    buf = io.BytesIO()
    torch.save(state, buf)
    write_atomic(rank_state_file(path, rank), buf.getvalue())


def load_rank_state(path: Path, rank: int) -> int:
    """Restores this process's random-number states; returns the saved optimizer step."""
    state = torch.load(rank_state_file(path, rank), weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"]
