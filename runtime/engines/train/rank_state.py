"""A training checkpoint's per-rank part: the optimizer step and the random-number states.

Both training engines (FSDP2 and Megatron) save it beside their sharded model and optimizer states, so
that a resumed run draws the same random numbers as a straight one.
"""

from __future__ import annotations

import io
import os
import random

import torch

from hybridflow.runtime.controller.locations import Location
from hybridflow.simulator.errors import HflowError


def rank_state_file(path: str | os.PathLike | Location, rank: int) -> Location:
    """Beside the rank's shards, in a local folder or at a URL."""
    return Location(path) / f"extra_rank{rank}.pt"


def check_checkpoint_folder(path: str | os.PathLike | Location, rank: int, shards: str, writer: str) -> None:
    """One-line error unless `path` holds the `shards` folder and this rank's state file, as `writer`
    (the engine's save) leaves them: both engines refuse a wrong folder before reading anything."""
    path = Location(path)
    extra_file = rank_state_file(path, rank)
    if not (path / shards).is_dir() or not extra_file.is_file():
        raise HflowError(f"{path}: not a training checkpoint of this layout (need {shards}/ and {extra_file.name}); "
                         f"pass a folder written by {writer} with the same parallel config")


def save_rank_state(path: str | os.PathLike | Location, rank: int, step: int) -> None:
    state = {"step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    buf = io.BytesIO()
    torch.save(state, buf)
    rank_state_file(path, rank).write(buf.getvalue())


def load_rank_state(path: str | os.PathLike | Location, rank: int) -> int:
    """Restores this process's random-number states; returns the saved optimizer step."""
    state = torch.load(io.BytesIO(rank_state_file(path, rank).read_bytes()), weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state["step"]
