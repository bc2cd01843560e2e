"""RunConfig: what a run does that its Plan does not say — a tree of sections, each passed whole to what
uses it, resolved against the plan once (rl/resolve.py: `resolve_run`).

A Plan fixes the algorithm, the models, the workload shape and where everything runs; a RunConfig says
what to train on and how:

    seed: 0
    data:       {task: sort, prompts_file: null, dataset_size: 4096, chat_template: null,  # the dataset
                 overlong: error}                                            # prompts over prompt_len
    sampling:   {temperature: 1.0, top_p: 1.0, top_k: 0, stop: [], rollout: null}   # every rollout, the log-probs
    optimizer:  {actor: {lr: 2.0e-4, warmup_steps: 0, schedule: constant, decay_steps: null, weight_decay: 0.0,
                         betas: [0.9, 0.95], grad_clip: 1.0},
                 critic: {lr: 1.0e-3, ...}}                                  # each trained role's engine
    eval:       {prompts_file: null, every: 0, samples: 4, max_prompts: 64, correct: 1.0, show: 3}   # held-out set
    checkpoint: {save_every: 1, keep_last: 3}                                # the trainer's checkpoints
    cluster:    {start_timeout_s: 600, call_timeout_s: null, max_restarts: 0,    # worker groups, restarts,
                 preempt_grace_s: 25}                                        # SIGTERM's grace
    scoring:    {workers: 0, timeout_s: null, timeout_score: null}          # reward/cost functions' processes
    logging:    {sample_log_every: 10, sample_log_count: 3}                  # sampled responses shown
    lora:       {actor: null, critic: null}   # {rank, alpha, dropout, target_modules}: over the plan's `lora`
    agent:      {tools: [], environment: null, max_turns: 4, max_tokens: 256, ...}   # multi-turn rollouts
    async_mode: {partial_rollout_tokens: null}   # async mode: tokens per response per round (partial rollouts), or auto
    loss, kl, advantage, shaping, lagrange, value_loss                       # the algorithm's settings

Run-level defaults suit the tiny model on the built-in `sort` task. A section given in part keeps the
defaults of the fields it leaves out (`optimizer: {actor: {warmup_steps: 10}}` keeps the actor's lr).
The algorithm's settings (simulator/algorithms/settings.py) have per-algorithm defaults in its registry
entry; resolving fills every field the config leaves unset from them (a YAML `kl: {coef: 0.02}` keeps
the algorithm's KL placement and estimator), so each default lives in one place (rl/resolve.py).
`with_overrides` sets fields by dotted path (`--set optimizer.actor.lr=1e-4` on the command line).
"""

from __future__ import annotations

import math
from typing import Any, Literal

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

from hybridflow.runtime.agents.settings import AgentSettings
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.policy_cache import WarmupConfig
from hybridflow.simulator.algorithms import RLSettings, get_algorithm, merge_settings
from hybridflow.simulator.errors import HflowError, describe_validation_error
from hybridflow.simulator.vocabulary.lora import LoraConfig
from hybridflow.simulator.vocabulary.plan import RolloutBackend

_SECTION = ConfigDict(extra="forbid", frozen=True)


class DataConfig(BaseModel):
    model_config = _SECTION

    task: str = "sort"  # built-in task: prompts, reward and the warm-up policy
    # JSONL, Parquet or a `datasets` save_to_disk folder with a 'prompt' column (replaces the task's prompts)
    prompts_file: str | None = None
    dataset_size: PositiveInt = 4096  # prompts drawn from the built-in task
    # Chat-message prompts always go through the tokenizer's chat template; plain-text prompts too (as one
    # user message, the generation prompt added) when true — or, left unset, when the actor's tokenizer has one
    chat_template: bool | None = None
    # a prompt longer than the plan's prompt_len: an error before the run starts (naming it), cut to its
    # last (truncate-left) or first (truncate-right) prompt_len tokens, or left out of the data (drop)
    overlong: Literal["error", "truncate-left", "truncate-right", "drop"] = "error"

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str) -> str:
        return get_task(name).name  # any case; an unknown name is a one-line error with "did you mean"


class SamplingConfig(BaseModel):
    model_config = _SECTION

    temperature: NonNegativeFloat = 1.0  # log-probs are taken at it too (0: greedy, log-probs at 1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    # a response ends at the first of these strings (kept in it), as at an EOS; its later tokens are masked out
    stop: tuple[str, ...] = ()
    rollout: RolloutBackend | None = None  # the generation engine; None: the plan's (its actor's `rollout`)

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in stop):
            raise ValueError("a stop string cannot be empty")
        return stop


class EvalConfig(BaseModel):
    """The held-out set a run evaluates on: before the first update, every `every` iterations and at the
    end — greedy accuracy (reward ≥ `correct`), pass@`samples` (sampled with the run's sampling settings),
    the response lengths and a few samples (runtime/rl/evaluation.py)."""

    model_config = _SECTION

    # JSONL, Parquet or a `datasets` folder (its test / validation split); None with a DatasetDict of
    # training prompts that has a test or validation split: that split
    prompts_file: str | None = None
    every: NonNegativeInt = 0  # iterations between evaluations (0: only before the first update and at the end)
    samples: PositiveInt = 4  # k of pass@k: sampled responses per held-out prompt
    max_prompts: PositiveInt = 64  # held-out prompts evaluated (the first ones of the set)
    correct: float = 1.0  # a response with this reward or more counts as correct
    show: NonNegativeInt = 3  # greedy samples shown with each evaluation


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
    # on SIGTERM (a scheduler's notice): finish the step, save, end (exit 143) within this many seconds;
    # past it, whatever runs is abandoned and the last checkpoint stands (keep it under the scheduler's own grace)
    preempt_grace_s: PositiveFloat = 25.0


class ScoringConfig(BaseModel):
    """How the rule-based reward and cost functions run (runtime/tasks/reward_pool.py)."""

    model_config = _SECTION

    workers: NonNegativeInt = 0  # processes scoring in parallel, in batches; 0: on the driver, one sample at a time
    # the longest one sample's call may take (it is stopped then); needs workers (1 when left at 0); None: no limit
    timeout_s: PositiveFloat | None = None
    timeout_score: float | None = None  # a timed-out sample's score; None: a timeout ends the run (one line)

    @model_validator(mode="after")
    def _score_needs_a_timeout(self) -> ScoringConfig:
        if self.timeout_score is not None and (self.timeout_s is None or not math.isfinite(self.timeout_score)):
            raise ValueError("timeout_score (--reward-timeout-score) is a finite score for samples whose call passed "
                             "timeout_s; set timeout_s too (--reward-timeout S)")
        return self


class LoraSection(BaseModel):
    """LoRA adapters per trained role over the plan's (RolePlan.lora; simulator/vocabulary/lora.py): None keeps
    the plan's. A LoRA actor's reference is its base model, so its plan has no 'ref' role."""

    model_config = _SECTION

    actor: LoraConfig | None = None
    critic: LoraConfig | None = None  # every critic (critic, cost_critic)


class AsyncModeConfig(BaseModel):
    """Settings of the `async` execution mode (runtime/rl/modes/streaming.py)."""

    model_config = _SECTION

    # partial rollouts (rl/partial_rollouts.py): each round generates at most this many new tokens per response,
    # an unfinished response is continued in a later round; None: off (every response generated in one call);
    # auto: the budget the simulator prices fastest for the plan, or off where none pays, set before the run starts
    # (tools/preflight/partial_budget.py: the runtime itself prices nothing)
    partial_rollout_tokens: PositiveInt | Literal["auto"] | None = None

    @field_validator("partial_rollout_tokens", mode="before")
    @classmethod
    def _number_or_auto(cls, v):
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"expected a positive whole number of tokens, auto or null, got {v!r}")


class LoggingConfig(BaseModel):
    model_config = _SECTION

    # a few sampled prompts, responses and rewards go to the metrics and the console on the first
    # iteration and every `sample_log_every` after it (0: never)
    sample_log_every: NonNegativeInt = 10
    sample_log_count: PositiveInt = 3


def describe_run_config_errors(err: ValidationError, source: str) -> str:
    """Every problem of a run config in one line, each with its field and, for a field in the wrong
    section, where it goes (`optimizer: {warmup_steps: 5}` → optimizer.actor.warmup_steps)."""
    parts = []
    for problem in err.errors():
        loc = [str(p) for p in problem["loc"] if not str(p).startswith("function-")]
        where = ".".join(loc) or "(top level)"
        msg = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden" and loc:
            name = loc[-1]
            home = [f"{'.'.join(loc[:-1] + [r])}.{name}" for r in ("actor", "critic")
                    if loc[:-1] == ["optimizer"] and name in OptimConfig.model_fields]
            home += [f"{s}.{name}" for s, f in RunConfig.model_fields.items()
                     if _is_section(f) and name in f.annotation.model_fields and len(loc) == 1]
            msg = "unknown field" + (f"; it goes under {' or '.join(home)}" if home else "")
        parts.append(f"'{where}': {msg}")
    return f"{source}: {len(parts)} bad field(s) — " + "; ".join(parts) if len(parts) > 1 else f"{source}: field {parts[0]}"


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
    eval: EvalConfig = EvalConfig()
    scoring: ScoringConfig = ScoringConfig()
    lora: LoraSection = LoraSection()
    agent: AgentSettings = AgentSettings()  # multi-turn tool / environment rollouts (docs/agents.md)
    async_mode: AsyncModeConfig = AsyncModeConfig()  # the `async` mode's own settings (partial rollouts)

    @classmethod
    def load(cls, path) -> RunConfig:
        """A run config file (YAML or JSON); every bad field named in one line."""
        from hybridflow.simulator.io import read_mapping

        try:
            return cls.model_validate(read_mapping(path))
        except ValidationError as e:
            raise HflowError(describe_run_config_errors(e, str(path))) from None

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
            raise HflowError(describe_run_config_errors(e, "run config")) from None

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
