"""A group of fresh local processes, one per device, in one torch.distributed group: where the probes
and the profile's jobs run (hardware_probe.py, profiling.py, profile_check.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.runtime.engines.launch import ENGINE_PRELOAD, MEGATRON_PRELOAD, run_local


def run_group(fn: Callable, world: int, *args, timeout: float = 1800.0,
              on_progress: Callable[[int], None] | None = None, megatron: bool = False) -> list:
    """`fn(rank, world, *args)` on `world` fresh processes of one process group; results by rank.
    megatron.core takes seconds to import: preloaded (once, in the forkserver) only for Megatron jobs."""
    preload = ENGINE_PRELOAD + (MEGATRON_PRELOAD if megatron else [])
    return run_local(fn, world, *args, timeout=timeout, preload=preload, on_progress=on_progress)


def local_device() -> torch.device:
    """The device this process computes on: its GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
