"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised outcome advantages, no critic, KL in the loss."""

from __future__ import annotations

from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import (
    AdvantageSettings,
    KLSettings,
    PolicyLossSettings,
    RLSettings,
)


@algorithm("grpo", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="grpo", normalize_std=True),
                               loss=PolicyLossSettings(aggregation="seq-mean-token-mean"),
                               kl=KLSettings(coef=0.001, placement="loss", estimator="k3")))
def grpo(df, batch):
    """GRPO: A_i = (r_i − mean(r_group)) / std(r_group) on every token; loss + β·k3 KL, seq-mean-token-mean."""
    batch = df.generate(batch)  # the trainer repeats each prompt samples_per_prompt times, consecutively
    pending = df.ref_logprob(batch), df.actor_logprob(batch)
    batch = df.gather(df.score(batch), *pending)
    batch = df.advantage(batch)
    return df.update(batch), batch
