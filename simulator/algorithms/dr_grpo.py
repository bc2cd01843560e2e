"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO without its two length/difficulty biases."""

from __future__ import annotations

from hybridflow.simulator.algorithms.grpo import grpo
from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import (
    AdvantageSettings,
    KLSettings,
    PolicyLossSettings,
    RLSettings,
)


@algorithm("dr-grpo", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="grpo", normalize_std=False),
                               loss=PolicyLossSettings(aggregation="seq-mean-token-sum-norm"),
                               kl=KLSettings(coef=0.0, placement="loss", estimator="k3")))
def dr_grpo(df, batch):
    """Dr.GRPO: A_i = r_i − mean(r_group) (no std), loss Σ_t / L_max (a constant, not |o_i|), no KL."""
    return grpo(df, batch)
