"""A LoRA role's measured memory against the memory model (simulator/pricing/memory.py): the FSDP engine's own
tensors on 2 gloo processes in bf16 compute — the frozen base kept in bf16, the adapters in fp32 with their
gradients and Adam states — within 15 % of state_bytes + the update's gradients, part by part where the parts
mean the same thing. Activations are not measured here (no device allocator on the CPU)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import nll_loss, tiny_model, token_batch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
from hybridflow.simulator import Workload
from hybridflow.simulator.pricing.memory import state_bytes, train_transient
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_params
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

pytest.importorskip("peft")

SHAPE = dict(hidden_size=256, intermediate_size=512, vocab_size=512)
LORA = LoraConfig(rank=8)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors):
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _measure(rank, world, lora):
    engine = FsdpEngine(tiny_model(**SHAPE), ParallelConfig(dp=world), optim=OptimConfig(lr=1e-3), micro_batch_size=4,
                        lora=lora, mixed_precision=True)
    engine.train_step(TensorDict(token_batch(n=4, vocab=512), batch_size=[4]), nll_loss)
    params = list(engine.model.parameters())
    return dict(weights=_nbytes(params), gradients=_nbytes(p.grad for p in params if p.grad is not None),
                optimizer=_nbytes(v for st in engine.optimizer.state.values() for v in st.values()
                                  if torch.is_tensor(v) and v.dim() > 0),
                frozen_dtypes={str(_local(p).dtype) for p in params if not p.requires_grad})


@pytest.mark.slow
def test_lora_states_within_15_percent_of_the_memory_model():
    spec = ModelSpec.from_decoder_config(tiny_model(**SHAPE).config, "tiny-256")
    cfg = ParallelConfig(dp=2)
    states = state_bytes(spec, "lm", cfg, True, lora=LORA)
    grads = train_transient(spec, "lm", cfg, Workload(), lora=LORA).gradients
    model = {"weights": states.weights, "optimizer": states.optimizer, "gradients": grads}
    full_model = state_bytes(spec, "lm", cfg, True).total
    for got in run_distributed(_measure, 2, LORA):
        assert got["frozen_dtypes"] == {"torch.bfloat16"}
        measured = got["weights"] + got["gradients"] + got["optimizer"]
        predicted = sum(model.values())
        assert abs(measured - predicted) <= 0.15 * predicted, (got, model)
        assert abs(got["weights"] - model["weights"]) <= 0.15 * model["weights"], (got, model)
        assert measured < full_model / 3  # no fp32 master, gradients or Adam states for the base
        # adapters: fp32 weights + fp32 gradients + Adam m, v = 16 bytes each, as the model's 2 + 2 + 12
        assert got["gradients"] + got["optimizer"] == 12 * adapter_params(spec, LORA) // 2
