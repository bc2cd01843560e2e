"""Safe-RLHF (Dai et al. 2024) as PKU's implementation runs it: PPO-Lagrangian with a reward critic and a
cost critic, the Lagrange multiplier stepped before each policy update from recent episode costs."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from types import MappingProxyType

from hybridflow.simulator.algorithms.registry import Hooks, algorithm
from hybridflow.simulator.algorithms.settings import (
    AdvantageSettings,
    KLSettings,
    LagrangeSettings,
    RLSettings,
)


class LagrangeMultiplier:
    """λ ≥ 0 on the constraint E[cost] ≤ d, kept as log λ: each iteration, before the policy step, one
    gradient step on −(J_c − d)·λ over log λ, with J_c the mean cost of the last `window` episodes:
    log λ ← log λ + lr·(J_c − d)·λ, and λ ≤ max."""

    def __init__(self, settings: LagrangeSettings):
        self.value, self.lr, self.threshold, self.max = settings.init, settings.lr, settings.threshold, settings.max
        self.costs: deque[float] = deque(maxlen=settings.window)

    def update(self, costs: Iterable[float]) -> float:
        self.costs.extend(costs)
        mean_cost = sum(self.costs) / len(self.costs)
        lam = math.exp(math.log(self.value) + self.lr * (mean_cost - self.threshold) * self.value)
        self.value = min(lam, self.max) if self.max is not None else lam
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "costs": list(self.costs)}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
        self.costs.clear()
        self.costs.extend(state["costs"])


class Lagrangian(Hooks):
    # PKU splits the KL penalty between the two streams, so its pull on the policy is ½β whatever λ is.
    kl_shares = MappingProxyType({"reward": 0.5, "cost": -0.5})

    def driver_state(self, settings: RLSettings) -> LagrangeMultiplier:
        return LagrangeMultiplier(settings.lagrange)

    def on_scores(self, state: LagrangeMultiplier, scores) -> dict[str, float]:
        costs = scores["cost"].tolist()
        lam = state.update(costs)  # λ first, then the advantages that use it (PKU's order)
        return {"lagrange": lam, "episode_cost": sum(state.costs) / len(state.costs)}

    def combine(self, advantages, state: LagrangeMultiplier):
        lam = state.value
        return (advantages["reward"] - lam * advantages["cost"]) / (1.0 + lam)


@algorithm("safe-rlhf", roles=("actor", "critic", "cost_critic", "ref", "reward", "cost"),
           required=("actor", "critic", "cost_critic"), hooks=Lagrangian(),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="gae"),
                               kl=KLSettings(coef=0.01, placement="reward", estimator="k1")))
def safe_rlhf(df, batch):
    """Safe-RLHF: A = (A_r − λ·A_c) / (1 + λ), A_r and A_c by GAE on the reward and cost critics' values."""
    batch = df.generate(batch)
    pending = (df.ref_logprob(batch), df.actor_logprob(batch), df.values(batch, "critic"),
               df.values(batch, "cost_critic"))
    batch = df.gather(df.score(batch), *pending)  # reward and cost
    batch = df.advantage(batch)
    return df.update(batch), batch
