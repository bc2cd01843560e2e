"""RLOO (Ahmadian et al. 2024): REINFORCE with the leave-one-out mean of the other samples as baseline."""

from __future__ import annotations

from hybridflow.simulator.algorithms.grpo import grpo
from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, RLSettings


@algorithm("rloo", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="rloo"),
                               kl=KLSettings(coef=0.01, placement="reward", estimator="k1")))
def rloo(df, batch):
    """RLOO: A_i = r_i − (1/(k−1)) Σ_{j≠i} r_j, with r the score minus β·Σ_t KL_t (the paper's sequence reward)."""
    return grpo(df, batch)
