"""The algorithm registry: one entry per RL algorithm, holding its driver loop, roles, defaults and hooks.

    @algorithm("grpo", roles=("actor", "ref", "reward"), defaults=RLSettings(...))
    def grpo(df, batch):
        batch = df.generate(batch)
        ...
        return df.update(batch), batch

The loop is the single description of the algorithm: the runtime runs it on its Dataflow
(runtime/rl/dataflow.py: each op a call on a worker group), the simulator runs it on a recording
dataflow (recording.py) to get the graph of ops it prices. A loop only calls the dataflow's ops
and never looks inside a batch, so it imports nothing and runs against either.

The ops a loop may call (both dataflows implement them):

    generate(batch, greedy=False) -> batch        the actor's rollout (greedy: ReMax's baseline)
    score(batch) -> batch                          the reward (and the cost, when the algorithm has one)
    fill_batch(batch) -> batch                     dynamic sampling: drop groups `hooks.keep_groups`
                                                   rejects, generate and score more until full
    ref_logprob / actor_logprob(batch) -> pending  log-probs (None when the plan has no ref model, or
                                                   the update's own log-probs serve as the old ones)
    values(batch, critic="critic") -> pending      a critic's values (None when the plan lacks it)
    gather(batch, *pending) -> batch               wait for pending calls, merge their outputs
    advantage(batch, baseline=None) -> batch       the estimator of the run's settings (driver)
    update(batch) -> metrics                       every critic's and the actor's optimizer steps

Algorithm-specific driver steps are hooks of the entry (a `Hooks` subclass), called by those ops.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hybridflow.simulator.algorithms.settings import RLSettings
from hybridflow.simulator.names import lookup
from hybridflow.simulator.vocabulary.roles import ROLES

Loop = Callable[[Any, Any], tuple[dict, Any]]


class Hooks:
    """Algorithm-specific driver steps the runtime's generic ops call. Torch-free: tensor arguments are
    used through their own methods, so the entry stays importable by the simulator."""

    # How a KL penalty in the reward is shared among the score streams (token reward −= share·β·KL).
    kl_shares: Mapping[str, float] = MappingProxyType({"reward": 1.0})

    def driver_state(self, settings: RLSettings):
        """State the driver keeps across iterations (checkpointed: state_dict / load_state_dict)."""
        return None

    def on_scores(self, state, scores: Mapping[str, Any]) -> dict[str, float]:
        """Called with each iteration's scores ([B] tensors by stream) before the advantages; metrics out."""
        return {}

    def combine(self, advantages: Mapping[str, Any], state):
        """The policy's advantages from each score stream's ([B, T] tensors)."""
        return advantages["reward"]

    def keep_groups(self, scores):
        """fill_batch: which prompt groups to keep, from the reward scores [groups, samples]; None: all."""
        return None


@dataclass(frozen=True)
class Algorithm:
    name: str
    loop: Loop
    roles: tuple[str, ...]  # every role it can use, in call order
    required: tuple[str, ...]  # roles a plan must give it as models
    defaults: RLSettings
    hooks: Hooks = field(default_factory=Hooks)
    summary: str = ""

    @property
    def scores(self) -> tuple[str, ...]:
        """The score streams: the reward, and the cost for a constrained algorithm."""
        return tuple(s for s in ("reward", "cost") if s in self.roles)

    @property
    def critics(self) -> tuple[str, ...]:
        return tuple(r for r in ("critic", "cost_critic") if r in self.roles)

    @property
    def kl_in_reward(self) -> bool:
        """Whether its default settings fold a KL penalty into the rewards."""
        return self.defaults.kl_in_reward

    def check_roles(self, models, functions: Mapping[str, str | None]) -> None:
        """Raise ValueError (pydantic turns it into a one-line error) when the roles do not fit this algorithm.
        models: the roles given as models; functions: rule-based `reward`/`cost` functions by role."""
        for role in models:
            if role not in self.roles:
                raise ValueError(f"role '{role}' is not used by {self.name} (roles: {', '.join(self.roles)})")
        for role in self.required:
            if role not in models:
                raise ValueError(f"{self.name} needs a '{role}' model")
        for s in self.scores:
            if s not in models and not functions.get(s):
                raise ValueError(f"{self.name} needs a '{s}' model or a {s}_function ('module:function')")


_REGISTRY: dict[str, Algorithm] = {}


def algorithm(name: str, *, roles: tuple[str, ...], required: tuple[str, ...] = ("actor",),
              defaults: RLSettings | None = None, hooks: Hooks | None = None) -> Callable[[Loop], Loop]:
    """Register `loop` as the algorithm `name` (its docstring's first line is the summary)."""
    unknown = [r for r in (*roles, *required) if r not in ROLES]
    if unknown or "actor" not in required or not set(required) <= set(roles):
        raise ValueError(f"algorithm '{name}': roles {roles} / required {required} must be among {ROLES}, "
                         "include the actor and cover the required ones")

    def wrap(loop: Loop) -> Loop:
        if name in _REGISTRY:
            raise ValueError(f"algorithm '{name}' is registered twice")
        summary = (loop.__doc__ or "").strip().splitlines()[0] if loop.__doc__ else ""
        _REGISTRY[name] = Algorithm(name, loop, tuple(roles), tuple(required), defaults or RLSettings(),
                                    hooks or Hooks(), summary)
        return loop

    return wrap


def get_algorithm(name: str) -> Algorithm:
    """The algorithm `name` means (any case; one-line error with "did you mean" on a near miss)."""
    return _REGISTRY[lookup(name, _REGISTRY, "algorithm")]


def algorithm_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
