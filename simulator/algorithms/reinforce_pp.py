"""REINFORCE++ (Hu 2025): PPO's clipped update and token-level KL reward without a critic."""

from __future__ import annotations

from hybridflow.simulator.algorithms.grpo import grpo
from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, RLSettings


@algorithm("reinforce++", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="reinforce++", whiten=True),
                               kl=KLSettings(coef=0.01, placement="reward", estimator="k1")))
def reinforce_pp(df, batch):
    """REINFORCE++: G_t = Σ_{k≥t} γ^{k−t} r_k (r_k with −β·KL_k), advantages G whitened over the batch."""
    return grpo(df, batch)
