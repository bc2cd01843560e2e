"""LoRA: low-rank adapters trained on a frozen base model (Hu et al. 2021), as `peft` builds them.

A LoRA role trains only its adapters: every target linear layer W (out × in) gains A (rank × in) and
B (out × rank), and computes W·x + (alpha / rank)·B·A·dropout(x); B starts at zero, so an untrained
adapter leaves the base model's outputs unchanged. What this changes for a plan, written once here and
read by the pricing, the planner and the runtime:

- memory: the base weights stay in bf16 and get no gradients and no optimizer states; the adapters
  carry the trained model's 16 bytes per parameter (weights, gradients, fp32 master + Adam m, v);
  activations are those of the full model (the backward still runs through every layer);
- compute: the backward computes activation gradients through the frozen layers (one forward's worth
  of FLOPs) but weight gradients only for the adapters — 2 forward passes of work instead of 3;
- the reference policy is the actor's base: a LoRA actor's plan has no `ref` model, its reference
  log-probs are the actor's own with the adapters switched off;
- the weight sync to generation carries the adapters' bytes: the generation engine holds the base
  and merges the adapters it receives (native), or loads them through its LoRA API (vLLM).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from hybridflow.simulator.vocabulary.families import family
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.units import BF16

# How the actor's generation engine takes the adapters: merged into its own copy of the base weights
# (W + scale·B·A; the native engine), or as adapters through the engine's LoRA API (vLLM).
LoraRollout = Literal["merged", "adapter"]


class LoraConfig(BaseModel):
    """A role's adapters: rank, alpha (scale = alpha / rank), dropout on the adapters' input, and the
    linear layers they wrap (names inside a decoder layer; None: the model family's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: PositiveInt = 16
    alpha: PositiveFloat | None = None  # None: 2·rank (scale 2)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] | None = None

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.rank

    def targets(self, model: ModelSpec) -> tuple[str, ...]:
        """The layers the adapters wrap on `model` (its family's default unless given)."""
        return self.target_modules if self.target_modules is not None else family(model.family).lora_default

    def problems(self, model: ModelSpec) -> list[str]:
        known = family(model.family).lora_modules
        bad = [t for t in (self.target_modules or ()) if t not in known]
        out = []
        if bad:
            out.append(f"LoRA target module(s) {', '.join(bad)} are not linear layers of a {model.family} model "
                       f"(its layers: {', '.join(known)})")
        if self.target_modules is not None and not self.target_modules:
            out.append("LoRA target_modules is empty; name at least one layer or leave it out for the family's default")
        return out


def _linear_shapes(model: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """(in, out, copies per layer) of each linear layer an adapter may wrap."""
    h, d, f = model.hidden, model.dim_head, model.ffn
    q, kv = model.heads * d, model.kv_heads * d
    e = model.experts or 1
    return {"q_proj": (h, q, 1), "k_proj": (h, kv, 1), "v_proj": (h, kv, 1), "o_proj": (q, h, 1),
            "gate_proj": (h, f, 1), "up_proj": (h, f, 1), "down_proj": (f, h, 1),
            "w1": (h, f, e), "w3": (h, f, e), "w2": (f, h, e)}


def adapter_params(model: ModelSpec, lora: LoraConfig) -> int:
    """Parameters of the adapters: rank·(in + out) per wrapped linear layer, over all layers."""
    shapes = _linear_shapes(model)
    per_layer = sum(lora.rank * (shapes[t][0] + shapes[t][1]) * shapes[t][2] for t in lora.targets(model))
    return model.layers * per_layer


def adapter_bytes(model: ModelSpec, lora: LoraConfig) -> int:
    """The adapters in bf16: what a LoRA actor's weight sync moves to its generation engine."""
    return BF16 * adapter_params(model, lora)
