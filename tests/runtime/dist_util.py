"""Multi-process test helper: `run_distributed(fn, world_size, *args)` runs `fn(rank, world_size,
*args)` on that many gloo processes and returns each rank's result (see runtime/engines/launch.py)."""

from hybridflow.runtime.engines.launch import run_local as run_distributed

__all__ = ["run_distributed"]
