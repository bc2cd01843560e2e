"""OptimConfig: a trained role's optimizer and its learning-rate schedule, as the run config's
`optimizer` section gives it for each role and the training engines take it (torch-free, so a run
config is checked before torch loads)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    model_validator,
)


class OptimConfig(BaseModel):
    """AdamW (megatron's Adam with the same settings), a linear warm-up, then the learning rate constant or
    decayed (`schedule` linear or cosine over `decay_steps` optimizer steps after the warm-up, down to
    `min_lr_ratio` of `lr`), gradient clipping, and how many non-finite steps in a row stop the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: PositiveFloat = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0  # 0 turns clipping off
    warmup_steps: int = Field(0, ge=0)  # linear warm-up of the learning rate over this many optimizer steps
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # after the warm-up
    decay_steps: PositiveInt | None = None  # linear / cosine: optimizer steps from the warm-up's end to min_lr
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)  # the decayed learning rate's floor, as a share of lr
    # A step whose gradient norm (or loss) is not finite is skipped; this many in a row stop the run.
    max_skipped_steps: PositiveInt = 3

    @model_validator(mode="after")
    def _decay_needs_steps(self):
        if self.schedule != "constant" and self.decay_steps is None:
            raise ValueError(f"schedule '{self.schedule}' decays over decay_steps optimizer steps; set decay_steps "
                             "(e.g. iterations × mini_batches × ppo_epochs)")
        return self

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): the warm-up, then the schedule."""
        import math

        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        shape = 1.0 - done if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)
