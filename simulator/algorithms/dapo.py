"""DAPO (Yu et al. 2025): GRPO with clip-higher, dynamic sampling, token-level loss and overlong shaping."""

from __future__ import annotations

from hybridflow.simulator.algorithms.registry import Hooks, algorithm
from hybridflow.simulator.algorithms.settings import (
    AdvantageSettings,
    KLSettings,
    PolicyLossSettings,
    RewardShaping,
    RLSettings,
)


class DynamicSampling(Hooks):
    def keep_groups(self, scores):
        """Keep a prompt's group only when its rewards differ: an all-equal group has zero advantages
        and only dilutes the batch (DAPO §3.2)."""
        return scores.amax(-1) > scores.amin(-1)


@algorithm("dapo", roles=("actor", "ref", "reward"), hooks=DynamicSampling(),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="grpo"),
                               loss=PolicyLossSettings(clip_ratio=0.2, clip_ratio_high=0.28, aggregation="token-mean"),
                               kl=KLSettings(coef=0.0, placement="loss", estimator="k3"),
                               shaping=RewardShaping(overlong_buffer=0.2)))
def dapo(df, batch):
    """DAPO: clip r to [1 − 0.2, 1 + 0.28], token-mean loss, no KL, groups with equal rewards resampled,
    R_length = ((L_max − L_cache) − |y|) / L_cache in the last L_cache tokens of the budget."""
    batch = df.fill_batch(df.score(df.generate(batch)))  # the kept groups, topped up with new prompts
    pending = df.ref_logprob(batch), df.actor_logprob(batch)
    batch = df.gather(batch, *pending)
    batch = df.advantage(batch)
    return df.update(batch), batch
