"""REINFORCE++-baseline (Hu 2025): REINFORCE++ for outcome rewards with the group mean as the baseline."""

from __future__ import annotations

from hybridflow.simulator.algorithms.grpo import grpo
from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, RLSettings


@algorithm("reinforce++-baseline", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="reinforce++-baseline"),
                               kl=KLSettings(coef=0.01, placement="reward", estimator="k1")))
def reinforce_pp_baseline(df, batch):
    """REINFORCE++-baseline: Ã_i = r_i − mean(r_group), A_i = Ã_i / std_batch(Ã) on every token."""
    return grpo(df, batch)
