"""What the planner is asked: an algorithm, a model per role, a cluster, a workload, options."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from hybridflow.simulator.agents.planning import AgentWorkload
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.lora import LoraConfig
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import TrainBackend
from hybridflow.simulator.vocabulary.plan import AlgorithmName, context_problem
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, Role
from hybridflow.simulator.vocabulary.workload import Workload


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: AlgorithmName = "ppo"
    models: dict[Role, ModelSpec]  # roles that are neural models (they own devices)
    paths: dict[Role, str] = {}  # HF folders the models were read from: the plan records them for `run`
    cluster: ClusterSpec
    workload: Workload = Workload()
    reward_function: str | None = None  # rule-based reward ("module:function"): owns no devices
    cost_function: str | None = None
    max_pp: PositiveInt | None = None  # largest training pipeline size
    max_gen_pp: PositiveInt | None = None  # largest generation pipeline size (the runtime runs pp_g = 1)
    max_sp: PositiveInt | None = None  # largest sequence-parallel size (searched for long sequences, configs.py)
    # training engines the search may give each role (ParallelConfig.backend); more than one: it picks per role
    backends: tuple[TrainBackend, ...] = Field(("fsdp",), min_length=1)
    top_k: PositiveInt = 5
    # every trained role trains LoRA adapters on its frozen model; the actor's base is the reference (no `ref`)
    lora: LoraConfig | None = None
    # colocated models' states moved to host memory while another model of their set runs (Plan.offload):
    # "auto" plans with it only when nothing fits without it, "never" not at all, "always" only with it
    offload: Literal["auto", "never", "always"] = "auto"
    # rollouts are conversations with tool calls (`--agent-workload`): generation priced multi-turn
    agent: AgentWorkload | None = None

    @model_validator(mode="after")
    def _roles(self):
        for role in self.paths:
            if role not in self.models:
                raise ValueError(f"role '{role}' has a path but no model")
        get_algorithm(self.algorithm).check_roles(self.models, {"reward": self.reward_function,
                                                                "cost": self.cost_function})
        for role, model in self.models.items():
            context_problem(role, model, self.workload)
        if self.lora is not None:
            if "ref" in self.models:
                raise ValueError("a LoRA actor's reference is its own base model with the adapters off: drop the "
                                 "'ref' model")
            if "fsdp" not in self.backends:
                raise ValueError("LoRA trains on the fsdp backend only (megatron-core 0.16 has no LoRA of its own); "
                                 "add fsdp to the backends")
            for role, model in self.models.items():
                bad = self.lora.problems(model) if role in TRAINED_ROLES else []
                if bad:
                    raise ValueError(f"role '{role}': {'; '.join(bad)}")
        return self

    def lora_of(self, role: str) -> LoraConfig | None:
        """The role's LoRA adapters (trained roles of a LoRA request), else None."""
        return self.lora if role in TRAINED_ROLES else None

    @property
    def reference_roles(self) -> tuple[str, ...]:
        """The model roles, with `ref` where the LoRA actor's base serves as the reference."""
        with_ref = self.lora is not None and "ref" in get_algorithm(self.algorithm).roles
        return (*self.roles, "ref") if with_ref else self.roles

    @property
    def roles(self) -> tuple[str, ...]:
        """The model roles in the algorithm's call order."""
        return tuple(r for r in get_algorithm(self.algorithm).roles if r in self.models)

    @classmethod
    def for_algorithm(cls, algorithm: str, model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                      overrides: dict[str, ModelSpec] | None = None, **kw) -> SearchRequest:
        """Every role the algorithm uses gets `model`, then `overrides` per role."""
        models = {r: model for r in get_algorithm(algorithm).roles if not (r == "ref" and kw.get("lora"))}
        models.update(overrides or {})
        return cls(algorithm=algorithm, models=models, cluster=cluster, workload=workload, **kw)
