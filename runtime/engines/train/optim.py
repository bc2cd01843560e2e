"""OptimConfig: a trained role's optimizer and its learning-rate schedule, as the run config's
`optimizer` section gives it for each role and the training engines take it (torch-free, so a run
config is checked before torch loads)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt


class OptimConfig(BaseModel):
    """AdamW (megatron's Adam with the same settings), a linear warm-up, gradient clipping, and how many
    non-finite steps in a row stop the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: PositiveFloat = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0  # 0 turns clipping off
    warmup_steps: int = Field(0, ge=0)  # linear warm-up of the learning rate over this many optimizer steps
    # A step whose gradient norm (or loss) is not finite is skipped; this many in a row stop the run.
    max_skipped_steps: PositiveInt = 3
