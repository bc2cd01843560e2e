"""Megatron-core on a machine without CUDA: what the shim replaces, and why.

megatron-core is written for GPUs; on a CPU-only torch (gloo) its numerics run unchanged, but a few
narrow places ask CUDA for things that have a plain CPU meaning:

- the model-parallel RNG tracker saves and restores `torch.cuda` RNG states: `CpuRNGStatesTracker`
  keeps the same named states with the CPU generator;
- `torch.cuda.current_device()` (rotary embeddings, buffers, the optimizer, the MoE token dispatch)
  raises without CUDA: it answers the CPU device (not an index, which torch reads as a CUDA device:
  autograd runs backward functions outside the mode below, and the MoE dispatch allocates there);
- tensors made with `device="cuda"` (grad scaler, found-inf flags, norms) and `.cuda()` calls:
  `_CudaToCpu`, a TorchFunctionMode, makes them on the CPU;
- the optimizers check `param.type() == "torch.cuda.FloatTensor"`: a CPU tensor's type() answers
  with the CUDA name of its dtype inside the mode.

`megatron_on_cpu()` applies all of this for the duration of a `with`, and is a no-op when torch
has CUDA: on a GPU megatron-core runs as it is. On a CPU it also silences, for the process, the
notices megatron-core prints there that a user cannot act on (Transformer Engine / Apex / CUDA settings
absent, deprecations inside it): `quiet_cpu_notices`. Nothing here changes a result: the same losses as
one rank with the same weights (tests/runtime/test_megatron_*.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

_CPU_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                   "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _is_cuda(device) -> bool:
    if isinstance(device, int):  # a bare index means a CUDA device to torch
        return True
    return torch.device(device).type == "cuda" if isinstance(device, str | torch.device) else False


class _CudaToCpu(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU; `.cuda()` is the identity; a CPU
    float tensor's `type()` reads as its CUDA name (megatron's optimizers check it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CPU_TYPE_NAMES.get(name, name)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def cpu_rng_tracker_class():
    """Megatron's CudaRNGStatesTracker with its named states kept by the CPU generator."""
    quiet_cpu_notices()
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def quiet_cpu_notices() -> None:
    """Process-wide warning filters for what megatron-core prints on a CPU machine and a user cannot act
    on: its own notices (no Transformer Engine, Apex or CUDA settings; deprecations inside it) and torch's
    deprecation notices for calls megatron makes. Idempotent: a filter added again replaces itself."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    for message in (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
                    r"Please use DTensor instead and we are deprecating ShardedTensor",
                    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"):
        warnings.filterwarnings("ignore", message=message)


@contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run megatron-core calls inside on the CPU (no-op where torch has CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    quiet_cpu_notices()
    from megatron.core.tensor_parallel import random as mrandom

    # The tracker is megatron's own process-wide object: installed once, so named states persist.
    if type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ != "CpuRNGStatesTracker":
        mrandom._CUDA_RNG_STATE_TRACKER = cpu_rng_tracker_class()()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu")))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
        stack.enter_context(_CudaToCpu())
        yield
