"""LoRA adapters on a decoder of runtime/models/decoder.py, through `peft` (simulator/vocabulary/lora.py says
what they are and how they are priced).

`apply_lora` injects peft's LoRA layers in place (`peft.inject_adapter_in_model`): each target linear layer
`x.q_proj` becomes a peft `lora.Linear` holding the frozen `x.q_proj.base_layer` and the adapters
`x.q_proj.lora_A.default` / `lora_B.default`. The model keeps its own class, attributes and forward, so the
engines shard it as before (parallelize.py knows the peft layers' parts); nothing but the adapters (and a
critic's fresh scalar head) trains. The adapters are drawn from their own seed, so every rank — and a
hand-built peft model given the same seed — starts from the same ones.

    model = apply_lora(CausalLM(cfg), LoraConfig(rank=8), seed=0)
    with adapters_disabled(model):      # the base model: a LoRA actor's reference policy
        ref_logits = model(ids)

The weights at rest (merged into the plain model, peft's adapter folder) are models/lora_files.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hybridflow.runtime.models.lora_files import is_adapter
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lora import LoraConfig


def peft_lora_config(lora: LoraConfig, family: str, inference_mode: bool = False):
    """peft's LoraConfig for `lora` on a model of `family` (its default targets unless given)."""
    from peft import LoraConfig as PeftLoraConfig

    from hybridflow.simulator.vocabulary.families import family as family_of

    targets = lora.target_modules if lora.target_modules is not None else family_of(family).lora_default
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.lora_alpha, lora_dropout=lora.dropout,
                          target_modules=list(targets), bias="none", inference_mode=inference_mode)


def apply_lora(model: nn.Module, lora: LoraConfig, seed: int = 0) -> nn.Module:
    """Inject `lora`'s adapters into `model` (in place) with A drawn from `seed` (B starts at zero); freeze
    everything else but a scalar head (`score`, trained from scratch by a critic)."""
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise HflowError("LoRA needs peft: pip install -e '.[runtime]' (peft comes with it)") from None

    cfg = peft_lora_config(lora, model.config.family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(cfg, model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name.startswith("score."))
    return model


def lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the `with`: every LoRA layer computes its frozen layer alone."""
    layers = lora_layers(model)
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for n, p in model.named_parameters():  # peft's toggle touches requires_grad: as it was
            p.requires_grad_(trainable[n])
