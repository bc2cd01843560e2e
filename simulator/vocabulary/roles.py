"""The role vocabulary: the models an RLHF plan can hold, which of them train, which head each carries,
and which heads a role's Hugging Face folder may hold. Each algorithm (simulator/algorithms/) uses some
of these roles; a plan names a subset of its algorithm's, and `reward` / `cost` may instead be
rule-based functions on the driver."""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal

from hybridflow.simulator.vocabulary.decoder_config import Head

ROLES = ("actor", "critic", "cost_critic", "ref", "reward", "cost")
Role = Literal[ROLES]
TRAINED_ROLES = ("actor", "critic", "cost_critic")
SCALAR_HEAD_ROLES = ("critic", "cost_critic", "reward", "cost")
CRITIC_OF = MappingProxyType({"reward": "critic", "cost": "cost_critic"})  # the critic of each score stream

# The name the actor's generation runs under on rollout devices of its own (the actor's generate_group):
# in the planner a device set whose member only generates and holds no states, in the runtime a worker
# group's role; not a role of a plan.
ROLLOUT = "rollout"


def role_head(role: str) -> Head:
    """The head a role's model carries: a scalar head for critics and score models, else an LM head."""
    return "scalar" if role in SCALAR_HEAD_ROLES else "lm"


# The heads a role's model folder may hold: its own, and for a critic also a causal LM (its backbone
# under a fresh scalar head).
ROLE_HEADS: MappingProxyType[str, tuple[Head, ...]] = MappingProxyType(
    {r: (role_head(r), "lm") if r in CRITIC_OF.values() else (role_head(r),) for r in ROLES})
