"""ReMax (Li et al. 2024): REINFORCE with the reward of the greedy response as the baseline."""

from __future__ import annotations

from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, RLSettings


@algorithm("remax", roles=("actor", "ref", "reward"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="remax"),
                               kl=KLSettings(coef=0.01, placement="reward", estimator="k1")))
def remax(df, batch):
    """ReMax: A_t = Σ_{k≥t} r_k − r(greedy response), the greedy pass scored first."""
    greedy = df.score(df.generate(batch, greedy=True))  # the baseline: the greedy response's reward
    batch = df.generate(batch)
    pending = df.ref_logprob(batch), df.actor_logprob(batch)
    batch = df.gather(df.score(batch), *pending)
    batch = df.advantage(batch, baseline=greedy)
    return df.update(batch), batch
