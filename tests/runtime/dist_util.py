"""Multi-process test helper: `run_distributed(fn, world_size, *args)` runs `fn(rank, world_size,
*args)` on that many gloo processes and returns each rank's result (see runtime/engines/launch.py)."""

import pytest

from hybridflow.runtime.engines.launch import _installed
from hybridflow.runtime.engines.launch import run_local as run_distributed

__all__ = ["MEGATRON_INSTALLED", "needs_megatron", "run_distributed"]

# Whether megatron-core is installed, without importing it: the megatron ranks import it (the forkserver
# preloads it), the test session itself need not pay its seconds-long import to decide to skip.
MEGATRON_INSTALLED = _installed("megatron.core")
needs_megatron = pytest.mark.skipif(not MEGATRON_INSTALLED,
                                    reason="megatron-core not installed (pip install -e '.[megatron]')")
