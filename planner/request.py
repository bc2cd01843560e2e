"""What the planner is asked: an algorithm, a model per role, a cluster, a workload, options."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import TrainBackend
from hybridflow.simulator.vocabulary.plan import AlgorithmName
from hybridflow.simulator.vocabulary.roles import Role
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
    # training engines the search may give each role (ParallelConfig.backend); more than one: it picks per role
    backends: tuple[TrainBackend, ...] = Field(("fsdp",), min_length=1)
    top_k: PositiveInt = 5

    @model_validator(mode="after")
    def _roles(self):
        for role in self.paths:
            if role not in self.models:
                raise ValueError(f"role '{role}' has a path but no model")
        get_algorithm(self.algorithm).check_roles(self.models, {"reward": self.reward_function,
                                                                "cost": self.cost_function})
        return self

    @property
    def roles(self) -> tuple[str, ...]:
        """The model roles in the algorithm's call order."""
        return tuple(r for r in get_algorithm(self.algorithm).roles if r in self.models)

    @classmethod
    def for_algorithm(cls, algorithm: str, model: ModelSpec, cluster: ClusterSpec, workload: Workload,
                      overrides: dict[str, ModelSpec] | None = None, **kw) -> SearchRequest:
        """Every role the algorithm uses gets `model`, then `overrides` per role."""
        models = {r: model for r in get_algorithm(algorithm).roles}
        models.update(overrides or {})
        return cls(algorithm=algorithm, models=models, cluster=cluster, workload=workload, **kw)
