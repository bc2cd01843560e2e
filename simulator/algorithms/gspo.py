"""GSPO (Zheng et al. 2025): GRPO's advantages with a sequence-level importance ratio, clipped per sequence."""

from __future__ import annotations

from hybridflow.simulator.algorithms.grpo import grpo
from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import (
    AdvantageSettings,
    KLSettings,
    PolicyLossSettings,
    RLSettings,
)


@algorithm("gspo", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="grpo"),
                               loss=PolicyLossSettings(kind="gspo", clip_ratio=3e-4, clip_ratio_high=4e-4,
                                                       aggregation="seq-mean-token-mean"),
                               kl=KLSettings(coef=0.0, placement="loss", estimator="k3")))
def gspo(df, batch):
    """GSPO: s_i = (π(y_i)/π_old(y_i))^(1/|y_i|), loss −(1/G) Σ_i min(s_i A_i, clip(s_i, 1−ε, 1+ε_high) A_i)."""
    return grpo(df, batch)
