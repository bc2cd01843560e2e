"""The vLLM tests' one skip condition: why vLLM cannot run here (None: it can), and the marker built on it."""

from __future__ import annotations

import pytest

from hybridflow.runtime.engines.rollout.vllm_rollout import import_vllm
from hybridflow.simulator.errors import HflowError


def _vllm_missing() -> str | None:
    try:
        import_vllm()
    except HflowError as e:
        return str(e)
    return None


VLLM_MISSING = _vllm_missing()
needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=f"vLLM backend not testable here: {VLLM_MISSING}")
