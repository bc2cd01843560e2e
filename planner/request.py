"""What the planner is asked: an algorithm, a model per role, a cluster, a workload, options."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from hybridflow.simulator.hardware import ClusterSpec
from hybridflow.simulator.model import ModelSpec
from hybridflow.simulator.plan import ALGORITHM_ROLES, REQUIRED_ROLES, Algorithm, Role
from hybridflow.simulator.workload import Workload


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Algorithm = "ppo"
    models: dict[Role, ModelSpec]  # roles that are neural models (they own devices)
    paths: dict[Role, str] = {}  # HF folders the models were read from: the plan records them for `run`
    cluster: ClusterSpec
    workload: Workload = Workload()
    reward_function: str | None = None  # rule-based reward ("module:function"): owns no devices
    cost_function: str | None = None
    max_pp: PositiveInt | None = None  # largest training pipeline size
    max_gen_pp: PositiveInt | None = None  # largest generation pipeline size (the runtime runs pp_g = 1)
    top_k: PositiveInt = 5

    @model_validator(mode="after")
    def _roles(self):
        allowed = ALGORITHM_ROLES[self.algorithm]
        for role in self.models:
            if role not in allowed:
                raise ValueError(f"role '{role}' is not used by {self.algorithm} (roles: {', '.join(allowed)})")
        for role in self.paths:
            if role not in self.models:
                raise ValueError(f"role '{role}' has a path but no model")
        for role in REQUIRED_ROLES[self.algorithm]:
            if role not in self.models:
                raise ValueError(f"{self.algorithm} needs a '{role}' model")
        if "reward" not in self.models and not self.reward_function:
            raise ValueError("give a 'reward' model or a reward_function ('module:function')")
        if self.algorithm == "safe-rlhf" and "cost" not in self.models and not self.cost_function:
            raise ValueError("safe-rlhf needs a 'cost' model or a cost_function ('module:function')")
        return self

    @property
    def roles(self) -> tuple[str, ...]:
        """The model roles in the algorithm's call order."""
        return tuple(r for r in ALGORITHM_ROLES[self.algorithm] if r in self.models)

    @classmethod
    def for_algorithm(cls, algorithm: str, model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                      overrides: dict[str, ModelSpec] | None = None, **kw) -> SearchRequest:
        """Every role the algorithm uses gets `model`, then `overrides` per role."""
        models = {r: model for r in ALGORITHM_ROLES[algorithm]}
        models.update(overrides or {})
        return cls(algorithm=algorithm, models=models, cluster=cluster, workload=workload, **kw)
