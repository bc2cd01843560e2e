"""PPO for RLHF (Ouyang et al. 2022, InstructGPT): a critic, GAE, and a k1 KL penalty in the reward."""

from __future__ import annotations

from hybridflow.simulator.algorithms.registry import algorithm
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, RLSettings


@algorithm("ppo", roles=("actor", "critic", "ref", "reward"), required=("actor", "critic"),
           defaults=RLSettings(advantage=AdvantageSettings(estimator="gae", whiten=True),
                               kl=KLSettings(coef=0.01, placement="reward", estimator="k1")))
def ppo(df, batch):
    """PPO: r_t = score·[t = last] − β·(log π − log π_ref)_t, GAE advantages, clipped surrogate."""
    batch = df.generate(batch)
    # Log-prob and value calls go out first: they overlap the scoring on disjoint device groups.
    pending = df.ref_logprob(batch), df.actor_logprob(batch), df.values(batch)
    batch = df.gather(df.score(batch), *pending)
    batch = df.advantage(batch)
    return df.update(batch), batch
