"""Plan: the planner's output and the runtime's input — one JSON document, validated and versioned.

For each model role: the colocation group it lives in (groups own disjoint devices), its training
ParallelConfig and, for the actor, its generation ParallelConfig. The actor's generation either
runs in its own group through the 3D-HybridEngine (`generate_group` unset) or on a separate group
of inference devices (OpenRLHF-style, `generate_group` set), with the generation engine the
actor's `rollout` names: the native KV-cache engine or vLLM.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    model_validator,
)

from hybridflow.simulator.agents.workload import AgentWorkload
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError, describe_validation_error
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.lora import LoraConfig, LoraRollout
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.model import ModelSpec, preset_if_named
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, Role
from hybridflow.simulator.vocabulary.workload import Workload

PLAN_VERSION = 1

# How the actor's weights reach generation: resharded on its own devices by the 3D-HybridEngine (ours,
# HybridFlow-V's vanilla gather, DeepSpeed-Chat's full gather), or broadcast to separate rollout devices.
ReshardMode = Literal["hybridflow", "hybridflow-v", "ds-chat", "broadcast"]
RESHARD_MODES: tuple[str, ...] = get_args(ReshardMode)
IN_PLACE_RESHARDS = tuple(m for m in RESHARD_MODES if m != "broadcast")  # the 3D-HybridEngine's reshards
RolloutBackend = Literal["native", "vllm"]  # the engine that generates the actor's responses
ROLLOUT_BACKENDS: tuple[str, ...] = get_args(RolloutBackend)
# How rollout and training take turns: `sync` generates each batch with the newest weights;
# `one-step-off` generates batch i+1 (on separate rollout devices) while the actor trains on batch
# i, so a batch's policy is at most one update old (staleness ≤ 1); `async` streams rollouts into
# a bounded queue and trains on a batch whose policy is at most `max_staleness` updates old.
ExecutionMode = Literal["sync", "one-step-off", "async"]
EXECUTION_MODES: tuple[str, ...] = get_args(ExecutionMode)
STREAM_CHUNKS = 2  # `async` launches each batch of prompts as this many rollout calls


def stream_chunk_prompts(prompts: int) -> int:
    """Prompts per rollout call in `async` mode: its groups stream into the queue at this grain."""
    return max(1, -(-prompts // STREAM_CHUNKS))


def stream_calls(prompts: int) -> int:
    """Rollout calls per batch in `async` mode (without partial rollouts, whose round is one call)."""
    return -(-prompts // stream_chunk_prompts(prompts))


def known_algorithm(name: str) -> str:
    """Pydantic validator: an algorithm name the registry knows (ValueError with the known names)."""
    try:
        get_algorithm(name)
    except HflowError as e:
        raise ValueError(str(e)) from None
    return name


AlgorithmName = Annotated[str, AfterValidator(known_algorithm)]


def default_micro_batch_tokens(workload: Workload, train: ParallelConfig) -> int | None:
    """A role's sequence-packing budget for a workload of response_lengths: the padded micro-batch's tokens
    (micro_batch_size · seq_len), as the simulator prices packed passes (pricing/sequence_batches.py micro_batches);
    None for fixed lengths or where the engine does not pack (megatron, pipeline stages)."""
    if workload.response_lengths is None or train.backend != "fsdp" or train.pp > 1:
        return None
    return workload.micro_batch_size * workload.seq_len


def token_budget_problem(role: str, rp, workload: Workload) -> None:
    """ValueError (one line) for a token budget the role cannot run: below the longest sequence, or on an
    engine that does not pack."""
    if rp.micro_batch_tokens < workload.seq_len:
        raise ValueError(f"role '{role}': micro_batch_tokens {rp.micro_batch_tokens} is below the longest sequence "
                         f"(prompt_len + response_len = {workload.seq_len}); raise it to at least {workload.seq_len}")
    if rp.train.backend != "fsdp" or rp.train.pp > 1:
        raise ValueError(f"role '{role}': sequence packing (micro_batch_tokens) runs on the fsdp backend with "
                         f"pp=1, not {rp.train}; drop micro_batch_tokens or train with backend fsdp, pp 1")


def context_problem(role: str, model: ModelSpec, workload: Workload) -> None:
    """ValueError (one line) when the workload's longest sequence (prompt_len + response_len, the latter at least
    the response-length distribution's maximum) does not fit in `model`'s context (unknown: not checked)."""
    if model.context_len is not None and workload.seq_len > model.context_len:
        longest = "response_len" if workload.response_lengths is None else "the response lengths' maximum"
        raise ValueError(f"role '{role}': prompt_len {workload.prompt_len} + response_len {workload.response_len} = "
                         f"{workload.seq_len} tokens is beyond {model.name}'s context of {model.context_len} "
                         f"(its max_position_embeddings); lower prompt_len or {longest} to fit, or use a model "
                         "with a longer context")


def lora_problem(role: str, rp) -> None:
    """Raise ValueError when `rp`'s LoRA config cannot train `role` (pydantic makes it one line)."""
    if role not in TRAINED_ROLES:
        raise ValueError(f"role '{role}' is not trained: LoRA applies to {', '.join(TRAINED_ROLES)}; drop its lora")
    if rp.train.backend != "fsdp":
        raise ValueError(f"role '{role}': LoRA trains on the fsdp backend only (megatron-core 0.16 has no LoRA of "
                         "its own); set train.backend: fsdp or drop lora")
    if rp.train.pp > 1:
        raise ValueError(f"role '{role}': LoRA trains with pp=1 (got {rp.train}); use tensor and data parallelism")
    bad = rp.lora.problems(rp.model)
    if bad:
        raise ValueError(f"role '{role}': {'; '.join(bad)}")


def algorithm_name(name: str) -> str:
    """The algorithm `name` means (any case; one-line error with "did you mean" otherwise)."""
    return get_algorithm(name).name


class Device(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: int = Field(ge=0)
    index: int = Field(ge=0)


class DeviceGroup(BaseModel):
    """A colocation group: the models in it take turns on these devices."""

    model_config = ConfigDict(extra="forbid")

    name: str
    devices: list[Device]


class RolePlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    group: str
    train: ParallelConfig = ParallelConfig()
    generate: ParallelConfig | None = None  # actor only
    generate_group: str | None = None  # actor only: separate inference devices (OpenRLHF-style)
    path: str | None = None  # HF-format weights the runtime loads; None: build from `model`
    rollout: RolloutBackend = "native"  # actor only: the generation engine (a run config may override it)
    lora: LoraConfig | None = None  # trained roles: train LoRA adapters on the frozen model (vocabulary/lora.py)
    # Sequence packing: the real tokens per micro-batch of the role's forward/backward passes, sequences packed
    # back to back (engines/train/fsdp/packed.py); None: micro_batch_size padded rows. The search sets it for a
    # workload with response_lengths (default_micro_batch_tokens).
    micro_batch_tokens: PositiveInt | None = None
    # The rollout engine's knobs (actor only), as the search priced generation: its share of device memory and
    # the most sequences it decodes at once (vLLM's gpu_memory_utilization, max_num_seqs; the search sets them
    # from the memory model, cost.rollout_knobs); None: the engine's defaults. The native engine decodes each
    # batch whole and ignores them (a run config may switch the plan to vllm).
    rollout_memory_fraction: float | None = Field(None, gt=0, le=1)
    max_concurrent_sequences: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _model_by_name(cls, data):
        return preset_if_named(data)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = PLAN_VERSION
    algorithm: AlgorithmName = "ppo"
    cluster: ClusterSpec
    workload: Workload = Workload()
    groups: list[DeviceGroup]
    roles: dict[Role, RolePlan]
    reshard: ReshardMode = "hybridflow"
    reward_function: str | None = None  # "module:function" when the reward is rule-based
    cost_function: str | None = None
    offload: bool = False  # colocated models move their states to host memory when idle
    optimizer_offload: bool = False  # trained models keep Adam's states in host memory and step there (ZeRO-Offload)
    mechanics: Mechanics = Mechanics()  # how the engines run the ops (vocabulary/mechanics.py): a baseline's differ
    mode: ExecutionMode = "sync"
    max_staleness: int = Field(1, ge=1)  # `async`: the most updates a trained batch's policy may lag behind
    notes: str = ""
    # the measured profile it was priced with (`search --profile`): `simulate` and `run` price it on the same
    profile: str | None = None
    # rollouts are conversations with tool calls (`search --agent-workload`): `simulate` and `run` price the
    # rollout multi-turn as the search did (simulator/agents/planning.py); None: single-turn
    agent: AgentWorkload | None = None

    @model_validator(mode="before")
    @classmethod
    def _algorithm_by_name(cls, data):
        # `"algorithm": "PPO"` means ppo; a near miss is answered with "did you mean"
        if isinstance(data, dict) and isinstance(data.get("algorithm"), str):
            data = {**data, "algorithm": algorithm_name(data["algorithm"])}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        groups = {g.name: g for g in self.groups}
        if len(groups) != len(self.groups):
            raise ValueError("group names must be unique")
        seen: dict[tuple[int, int], str] = {}
        n, per = self.cluster.nodes, self.cluster.devices_per_node
        for g in self.groups:
            if not g.devices:
                raise ValueError(f"group '{g.name}' has no devices")
            for d in g.devices:
                if d.node >= n or d.index >= per:
                    raise ValueError(f"group '{g.name}' names device {d.node}:{d.index}, outside the {n}x{per} cluster")
                if (d.node, d.index) in seen:
                    raise ValueError(f"device {d.node}:{d.index} is in both '{seen[(d.node, d.index)]}' and '{g.name}'")
                seen[(d.node, d.index)] = g.name
        actor = self.roles.get("actor")
        if self.mode != "sync" and (actor is None or not actor.generate_group):
            raise ValueError(f"mode '{self.mode}' overlaps rollout with training, which needs the actor's generation "
                             "on devices of its own: give the actor a generate_group, or use mode 'sync'")
        get_algorithm(self.algorithm).check_roles(self.roles, {"reward": self.reward_function,
                                                               "cost": self.cost_function})
        for role, rp in self.roles.items():
            for gname in (rp.group, rp.generate_group):
                if gname is not None and gname not in groups:
                    raise ValueError(f"role '{role}' names unknown group '{gname}' (groups: {', '.join(groups)})")
            size = len(groups[rp.group].devices)
            if rp.train.world_size != size:
                raise ValueError(f"role '{role}': train config {rp.train} uses {rp.train.world_size} devices "
                                 f"but group '{rp.group}' has {size}")
            if rp.generate is not None and rp.generate.backend != "fsdp":
                raise ValueError(f"role '{role}': backend is a training setting; set train.backend, not "
                                 "generate.backend")
            knobs = [k for k in ("rollout_memory_fraction", "max_concurrent_sequences") if getattr(rp, k) is not None]
            if role != "actor" and (rp.generate or rp.generate_group or rp.rollout != "native" or knobs):
                raise ValueError(f"role '{role}': only the actor has a generation config and a rollout backend")
            if rp.lora is not None:
                lora_problem(role, rp)
            context_problem(role, rp.model, self.workload)
            if rp.micro_batch_tokens is not None:
                token_budget_problem(role, rp, self.workload)
        if actor is not None and actor.lora is not None and "ref" in self.roles:
            raise ValueError("a LoRA actor's reference is its own base model with the adapters off: drop the "
                             "'ref' role (its log-probs come from the actor's weights)")
        return self

    # ---- views ------------------------------------------------------------------------------
    def group(self, name: str) -> DeviceGroup:
        return next(g for g in self.groups if g.name == name)

    def roles_in(self, group: str) -> list[str]:
        return [r for r, rp in self.roles.items() if rp.group == group]

    def generation_config(self) -> ParallelConfig:
        """The actor's generation layout; defaults to its training layout."""
        a = self.roles["actor"]
        return a.generate or a.train

    def weight_sync_mode(self) -> str:
        """How the actor's weights reach its generation engine, as a reshard mode (simulator/pricing/reshard.py):
        `broadcast` to separate generation devices; with the vLLM rollout every device gathers the
        whole model and vLLM takes its own tensor-parallel slice — DS-Chat's gather (volume and peak);
        else the plan's 3D-HybridEngine mode."""
        actor = self.roles.get("actor")
        if self.mechanics.gather_every_step:
            return "in-place"  # generation under ZeRO-3 gathers as it goes (pricing/reshard.py IN_PLACE)
        if self.mechanics.system == "deepspeed-chat":
            return "hybrid-engine"  # its inference containers keep a tensor-parallel slice (pricing/reshard.py)
        if actor is not None and actor.generate_group:
            return "broadcast"
        if actor is not None and actor.rollout == "vllm":
            return "ds-chat"
        return self.reshard

    @property
    def ref_from_actor(self) -> bool:
        """Whether the reference log-probs come from the actor's base (a LoRA actor, adapters off)."""
        actor = self.roles.get("actor")
        return actor is not None and actor.lora is not None and "ref" in get_algorithm(self.algorithm).roles

    def reference_roles(self) -> list[str]:
        """The plan's roles, with `ref` where the actor's base serves as the reference (LoRA)."""
        return [*self.roles, "ref"] if self.ref_from_actor else list(self.roles)

    def lora_rollout(self) -> LoraRollout | None:
        """How a LoRA actor's generation engine takes its adapters: merged into its own base copy (the native
        engine) or through vLLM's LoRA adapter API; None without LoRA."""
        actor = self.roles.get("actor")
        if actor is None or actor.lora is None:
            return None
        return "adapter" if actor.rollout == "vllm" else "merged"

    @property
    def staleness(self) -> int:
        """How many updates a trained batch's policy may lag behind the newest, by execution mode."""
        return {"sync": 0, "one-step-off": 1}.get(self.mode, self.max_staleness)

    def with_mode(self, mode: str) -> Plan:
        """This plan run in execution `mode` (validated: an overlapping mode needs rollout devices)."""
        return Plan.from_json_text(self.model_copy(update={"mode": mode}).model_dump_json(), f"plan in mode '{mode}'")

    def placement(self) -> list[list[str]]:
        return [self.roles_in(g.name) for g in self.groups if self.roles_in(g.name)]

    def validate_parallel(self) -> Plan:
        """Check every config divides its model (raises HflowError with the first problem)."""
        per = self.cluster.devices_per_node
        for rp in self.roles.values():
            rp.train.validate_for(rp.model, per)
            if rp.generate:
                rp.generate.validate_for(rp.model, per)
                gsize = len(self.group(rp.generate_group).devices) if rp.generate_group else rp.train.world_size
                if rp.generate.world_size != gsize:
                    raise HflowError(f"actor generation config {rp.generate} uses {rp.generate.world_size} devices "
                                     f"but its group has {gsize}")
                regathers = self.weight_sync_mode() in ("hybrid-engine", "in-place")  # whole layers, any split
                if (not rp.generate_group and not regathers
                        and (rp.train.tp % rp.generate.tp or rp.train.pp % rp.generate.pp)):
                    raise HflowError(f"actor generation config {rp.generate} must have tp | {rp.train.tp} and "
                                     f"pp | {rp.train.pp} (3D-HybridEngine); pick divisors of the training layout")
        return self

    @classmethod
    def from_json_text(cls, text: str, source: str = "plan") -> Plan:
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise HflowError(describe_validation_error(e, source)) from None

    @classmethod
    def load(cls, path) -> Plan:
        """A plan file, its relative paths (model folders, `file.py:function`) read against its own folder."""
        from pathlib import Path

        from hybridflow.simulator.io import load_model_file

        return load_model_file(cls, path).validate_parallel().with_paths(Path(path).absolute().parent, anchor=True)

    def with_paths(self, folder, anchor: bool) -> Plan:
        """anchor: every relative path that exists under `folder` made absolute (a path that does not is left
        as written: an older plan's, relative to where it is run). Else: every local path made relative to
        `folder`, where the plan is written, so the plan and its files can move together."""
        import os
        from pathlib import Path

        def move(ref: str) -> str:
            p = Path(ref)
            if anchor:
                return str((folder / p).resolve()) if not p.is_absolute() and (folder / p).exists() else ref
            return os.path.relpath(p.absolute(), folder) if p.exists() else ref

        def fn(ref: str | None) -> str | None:
            if not ref or ref.count(":") != 1 or not ref.split(":")[0].endswith(".py"):
                return ref
            file, name = ref.split(":")
            return f"{move(file)}:{name}"

        roles = {r: rp.model_copy(update={"path": move(rp.path)}) if rp.path else rp for r, rp in self.roles.items()}
        return self.model_copy(update={"roles": roles, "reward_function": fn(self.reward_function),
                                       "cost_function": fn(self.cost_function)})
