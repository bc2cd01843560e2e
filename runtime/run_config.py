"""RunConfig: the RL hyper-parameters and inputs of a run — what a Plan does not say.

A Plan fixes the algorithm, the models, the workload shape and where everything runs; this says
what to train on (a built-in task or the user's prompt file and reward function), how to sample
and how to weigh the losses. Defaults suit the tiny model on the built-in `sort` task.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from .tasks.builtin import get_task
from .tasks.policy_cache import WarmupConfig


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    # ---- data ----------------------------------------------------------------------------------
    task: str = "sort"  # built-in task: prompts, reward and the warm-up policy
    prompts_file: str | None = None  # JSONL or Parquet with a 'prompt' column (replaces the task's prompts)
    dataset_size: PositiveInt = 4096  # prompts drawn from the built-in task
    # ---- sampling ------------------------------------------------------------------------------
    temperature: NonNegativeFloat = 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    # ---- optimisation --------------------------------------------------------------------------
    actor_lr: PositiveFloat = 2e-4
    critic_lr: PositiveFloat = 1e-3
    grad_clip: NonNegativeFloat = 1.0
    policy_loss: str = "ppo"
    clip_ratio: PositiveFloat = 0.2
    clip_ratio_high: PositiveFloat | None = None
    value_clip: PositiveFloat | None = 0.2
    entropy_coef: NonNegativeFloat = 0.0
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    # ---- KL to the reference policy ------------------------------------------------------------
    kl_coef: NonNegativeFloat = 0.01
    kl_mode: Literal["reward", "loss"] = "reward"  # folded into the token rewards, or a loss term
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k1"
    # ---- Safe-RLHF -----------------------------------------------------------------------------
    cost_threshold: float = 0.0
    lagrange_init: PositiveFloat = 1.0
    lagrange_lr: NonNegativeFloat = 0.05
    lagrange_max: PositiveFloat | None = 10.0
    # ---- checkpoints ---------------------------------------------------------------------------
    save_every: PositiveInt = 1  # iterations between checkpoints (with a checkpoint dir)
    keep_last: PositiveInt = 3  # complete checkpoints kept; older ones are deleted once a newer one is complete

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        return get_task(name).name  # any case; an unknown name is a one-line error with "did you mean"

    def warmup_config(self) -> WarmupConfig:
        """How a role without weights gets its built-in policy on this run's task and seed."""
        return WarmupConfig(task=self.task, seed=self.seed)

    @property
    def kl_in_reward(self) -> bool:
        """Whether a KL penalty is folded into the rewards (it then needs the old log-probs before the
        advantages, so the actor keeps its separate `actor_logprob` pass)."""
        return self.kl_mode == "reward" and self.kl_coef > 0
