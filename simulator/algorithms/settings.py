"""The RL settings of a run, typed, each with one default.

An algorithm's entry (registry.py) overrides the few its paper sets; a run's config (the runtime's
RunConfig) overrides what the user sets. `merge_settings` does both the same way: the fields a
model was given explicitly (pydantic's `model_fields_set`, nested models field by field) replace
the defaults, and the result is validated as a whole, so a combination that is wrong only once
merged (a loss-term KL with k1) is refused there.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class PolicyLossSettings(BaseModel):
    """The actor's objective (runtime/algorithms/losses.py)."""

    model_config = _FROZEN

    kind: str = "ppo"  # a registered policy loss: ppo, reinforce, gspo
    clip_ratio: PositiveFloat = 0.2  # ε: the ratio is clipped to [1 − ε, 1 + ε_high]
    clip_ratio_high: PositiveFloat | None = None  # ε_high (DAPO's clip-higher); None: ε
    clip_ratio_c: float | None = Field(None, gt=1.0)  # dual-clip (Ye et al. 2020): −A·r ≤ −c·A for A < 0
    aggregation: Aggregation = "token-mean"  # how per-token losses become one number (losses.aggregate)
    entropy_coef: NonNegativeFloat = 0.0
    # C: the cap on an off-policy rollout's importance weights π_old/μ (runtime losses.behaviour_weights)
    behaviour_weight_cap: float = Field(2.0, ge=1.0)


class KLSettings(BaseModel):
    """The KL penalty to the reference policy: folded into the token rewards, or a term of the loss."""

    model_config = _FROZEN

    coef: NonNegativeFloat = 0.0  # β
    placement: Literal["reward", "loss"] = "reward"
    estimator: KLEstimator = "k1"
    target: PositiveFloat | None = None  # adaptive β (Ziegler et al. 2019): steer the KL towards this
    horizon: PositiveInt = 10000  # the adaptive controller's horizon, in sequences

    @model_validator(mode="after")
    def _coherent(self):
        # Checked once both fields are known: a partial override is completed by the algorithm's
        # defaults first (merge_settings validates the merged result with every field set).
        given = self.model_fields_set
        if {"placement", "estimator"} <= given and self.placement == "loss" and self.estimator == "k1":
            raise ValueError("a KL loss term with estimator k1 does not regularise (its expected gradient is 0); "
                             "use estimator k3 (or k2), or placement 'reward'")
        if {"placement", "target"} <= given and self.placement == "loss" and self.target is not None:
            raise ValueError("the adaptive KL controller (target) steers a KL in the reward; "
                             "use placement 'reward' or drop target")
        return self


class AdvantageSettings(BaseModel):
    """The advantage estimator (runtime/algorithms/advantages.py) and its knobs."""

    model_config = _FROZEN

    estimator: str = "gae"  # a registered estimator: gae, grpo, rloo, remax, reinforce++, reinforce++-baseline
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    whiten: bool = True  # GAE / REINFORCE++: whiten the advantages over the batch's response tokens
    normalize_std: bool = True  # GRPO: divide by the group's std (Dr.GRPO does not)


class ValueLossSettings(BaseModel):
    """The critics' objective (runtime/algorithms/losses.py value_loss): PPO's clipped value loss."""

    model_config = _FROZEN

    clip: PositiveFloat | None = 0.2  # each value stays within ±clip of the value it had at the rollout; None: off


class RewardShaping(BaseModel):
    """Changes to the score before advantages: DAPO's soft overlong penalty."""

    model_config = _FROZEN

    overlong_buffer: float | None = Field(None, gt=0.0, le=1.0)  # fraction of the response budget; None: off
    overlong_penalty: PositiveFloat = 1.0  # the penalty at the budget's end


class LagrangeSettings(BaseModel):
    """Safe-RLHF's Lagrange multiplier λ on the constraint E[cost] ≤ threshold."""

    model_config = _FROZEN

    threshold: float = 0.0
    init: PositiveFloat = 1.0
    lr: NonNegativeFloat = 0.05
    max: PositiveFloat | None = 10.0
    window: PositiveInt = 128  # recent episodes whose mean cost drives λ's step


class RLSettings(BaseModel):
    """Every setting an algorithm has a default for."""

    model_config = _FROZEN

    loss: PolicyLossSettings = PolicyLossSettings()
    kl: KLSettings = KLSettings()
    advantage: AdvantageSettings = AdvantageSettings()
    shaping: RewardShaping = RewardShaping()
    lagrange: LagrangeSettings = LagrangeSettings()
    value_loss: ValueLossSettings = ValueLossSettings()

    @property
    def kl_in_reward(self) -> bool:
        """Whether a KL penalty is folded into the rewards (which needs the old log-probs before the
        advantages: the actor keeps its `actor_logprob` pass)."""
        return self.kl.placement == "reward" and self.kl.coef > 0


M = TypeVar("M", bound=BaseModel)


def merge_settings(defaults: M, given: BaseModel) -> M:
    """`defaults` with the fields `given` sets explicitly (nested models merged the same way), validated
    as a whole (pydantic's ValidationError, located at the offending field, on a bad combination)."""
    return type(defaults).model_validate(_merged(defaults, given))


def _merged(defaults: BaseModel, given: BaseModel) -> dict:
    data = defaults.model_dump()
    for name in given.model_fields_set & set(type(defaults).model_fields):
        value, default = getattr(given, name), getattr(defaults, name)
        if isinstance(value, BaseModel) and isinstance(default, BaseModel):
            data[name] = _merged(default, value)
        else:
            data[name] = value.model_dump() if isinstance(value, BaseModel) else value
    return data
