"""RunConfig: what a run does that its Plan does not say — a tree of sections, each passed whole to what
uses it, resolved against the plan once (rl/resolve.py: `resolve_run`).

A Plan fixes the algorithm, the models, the workload shape and where everything runs; a RunConfig says
what to train on and how:

    seed: 0
    data:       {task: sort, prompts_file: null, dataset_size: 4096, chat_template: false}   # the dataset
    sampling:   {temperature: 1.0, top_p: 1.0, top_k: 0, rollout: null}    # every rollout, and the log-probs
    optimizer:  {actor: {lr: 2.0e-4, warmup_steps: 0, weight_decay: 0.0, betas: [0.9, 0.95], grad_clip: 1.0},
                 critic: {lr: 1.0e-3, ...}}                                  # each trained role's engine
    checkpoint: {save_every: 1, keep_last: 3}                                # the trainer's checkpoints
    cluster:    {start_timeout_s: 600, call_timeout_s: null, max_restarts: 0}   # worker groups, restarts
    logging:    {sample_log_every: 10, sample_log_count: 3}                  # sampled responses shown
    loss, kl, advantage, shaping, lagrange, value_loss                       # the algorithm's settings

Run-level defaults suit the tiny model on the built-in `sort` task. A section given in part keeps the
defaults of the fields it leaves out (`optimizer: {actor: {warmup_steps: 10}}` keeps the actor's lr).
The algorithm's settings (simulator/algorithms/settings.py) have per-algorithm defaults in its registry
entry; resolving fills every field the config leaves unset from them (a YAML `kl: {coef: 0.02}` keeps
the algorithm's KL placement and estimator), so each default lives in one place (rl/resolve.py).
`with_overrides` sets fields by dotted path (`--set optimizer.actor.lr=1e-4` on the command line).
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.policy_cache import WarmupConfig
from hybridflow.simulator.algorithms import RLSettings, get_algorithm, merge_settings
from hybridflow.simulator.errors import HflowError, describe_validation_error
from hybridflow.simulator.vocabulary.plan import RolloutBackend

_SECTION = ConfigDict(extra="forbid", frozen=True)


class DataConfig(BaseModel):
    model_config = _SECTION

    task: str = "sort"  # built-in task: prompts, reward and the warm-up policy
    # JSONL, Parquet or a `datasets` save_to_disk folder with a 'prompt' column (replaces the task's prompts)
    prompts_file: str | None = None
    dataset_size: PositiveInt = 4096  # prompts drawn from the built-in task
    # Chat-message prompts always go through the tokenizer's chat template; this also sends plain-text
    # prompts through it, as one user message (with the generation prompt added)
    chat_template: bool = False

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        return get_task(name).name  # any case; an unknown name is a one-line error with "did you mean"


class SamplingConfig(BaseModel):
    model_config = _SECTION

    temperature: NonNegativeFloat = 1.0  # log-probs are taken at it too (0: greedy, log-probs at 1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    rollout: RolloutBackend | None = None  # the generation engine; None: the plan's (its actor's `rollout`)


class OptimizerConfig(BaseModel):
    model_config = _SECTION

    actor: OptimConfig = OptimConfig(lr=2e-4)
    critic: OptimConfig = OptimConfig(lr=1e-3)  # every critic (critic, cost_critic)

    @model_validator(mode="before")
    @classmethod
    def _over_defaults(cls, data: Any) -> Any:
        # a role given in part keeps the defaults it leaves out (its lr above all)
        if isinstance(data, dict):
            data = {k: ({**cls.model_fields[k].default.model_dump(exclude_unset=True), **v}
                        if k in cls.model_fields and isinstance(v, dict) else v) for k, v in data.items()}
        return data


class CheckpointConfig(BaseModel):
    model_config = _SECTION

    save_every: PositiveInt = 1  # iterations between checkpoints (with a checkpoint dir)
    keep_last: PositiveInt = 3  # complete checkpoints kept; older ones are deleted once a newer one is complete


class ClusterConfig(BaseModel):
    model_config = _SECTION

    # each start stage of a worker group (placement, processes, rendezvous, each role's weights) may take
    # this long; a big model's load from a network filesystem needs minutes
    start_timeout_s: PositiveFloat = 600.0
    call_timeout_s: PositiveFloat | None = None  # the longest one call (generate, update, …) may take; None: no limit
    max_restarts: NonNegativeInt = 0  # after a lost worker or node: restart and resume from the last checkpoint


class LoggingConfig(BaseModel):
    model_config = _SECTION

    # a few sampled prompts, responses and rewards go to the metrics and the console on the first
    # iteration and every `sample_log_every` after it (0: never)
    sample_log_every: NonNegativeInt = 10
    sample_log_count: PositiveInt = 3


def _is_section(field) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


# Where the flat fields of earlier versions went, for a one-line answer to an old config file.
MOVED = {"task": "data.task", "prompts_file": "data.prompts_file", "dataset_size": "data.dataset_size",
         "chat_template": "data.chat_template", "temperature": "sampling.temperature", "top_p": "sampling.top_p",
         "top_k": "sampling.top_k", "rollout": "sampling.rollout", "actor_lr": "optimizer.actor.lr",
         "critic_lr": "optimizer.critic.lr", "grad_clip": "optimizer.actor.grad_clip (and optimizer.critic.grad_clip)",
         "value_clip": "value_loss.clip", "save_every": "checkpoint.save_every", "keep_last": "checkpoint.keep_last",
         "sample_log_every": "logging.sample_log_every", "sample_log_count": "logging.sample_log_count",
         "start_timeout_s": "cluster.start_timeout_s", "call_timeout_s": "cluster.call_timeout_s",
         "max_restarts": "cluster.max_restarts"}


class RunConfig(RLSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    data: DataConfig = DataConfig()
    sampling: SamplingConfig = SamplingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_flat_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old in data.keys() & MOVED.keys():
                raise ValueError(f"'{old}' is now {MOVED[old]}; nest it under its section")
        return data

    def warmup_config(self) -> WarmupConfig:
        """How a role without weights gets its built-in policy on this run's task and seed."""
        return WarmupConfig(task=self.data.task, seed=self.seed)

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
        """This config with fields set by dotted path ({"optimizer.actor.lr": 1e-4, "seed": 3}); what it
        left unset stays unset (so the algorithm's defaults still fill it)."""
        data = self.model_dump(exclude_unset=True)
        for path, value in overrides.items():
            *sections, name = path.split(".")
            node, model = data, type(self)
            for s in sections:
                field = model.model_fields.get(s)
                if field is None:
                    raise HflowError(f"run config: '{path}': no section '{s}' (sections: "
                                     f"{', '.join(k for k, f in model.model_fields.items() if _is_section(f))})")
                if not _is_section(field):
                    raise HflowError(f"run config: '{path}': '{s}' is a value, not a section")
                node, model = node.setdefault(s, {}), field.annotation
            node[name] = value
        try:
            return RunConfig.model_validate(data)
        except ValidationError as e:
            raise HflowError(describe_validation_error(e, "run config")) from None

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
