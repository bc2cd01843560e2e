"""The algorithms: one short driver loop each over the dataflow's ops (runtime/dataflow.py).

Each takes the dataflow `df` and this iteration's prompt batch (each prompt repeated
samples_per_prompt times in a row) and returns (update metrics, the finished batch).
Ops on disjoint device groups overlap: the log-prob and value calls are issued before the scoring
(rule-based scores run on the driver meanwhile; a reward model's call queues behind them on a
shared group, runs at once on its own), all are gathered together, and the critic and actor updates
run at once.
"""

from __future__ import annotations


def ppo(df, batch):
    batch = df.generate(batch)
    pending = df.ref_logprob(batch), df.actor_logprob(batch), df.values(batch)
    batch = df.gather(df.score(batch), *pending)
    batch = df.advantage(batch, "gae")
    return df.update(batch), batch


def grpo(df, batch, estimator="grpo"):
    batch = df.generate(batch)  # the trainer repeats each prompt samples_per_prompt times, consecutively
    pending = df.ref_logprob(batch), df.actor_logprob(batch)
    batch = df.gather(df.score(batch), *pending)
    batch = df.advantage(batch, estimator)
    return df.update(batch), batch


def rloo(df, batch):
    return grpo(df, batch, estimator="rloo")


def remax(df, batch):
    greedy = df.score(df.generate(batch, greedy=True))  # the baseline: the greedy response's reward
    batch = df.generate(batch)
    pending = df.ref_logprob(batch), df.actor_logprob(batch)
    batch = df.gather(df.score(batch), *pending)
    batch = df.advantage(batch, "remax", baseline=greedy["reward_scores"])
    return df.update(batch), batch


def safe_rlhf(df, batch):
    batch = df.generate(batch)
    pending = df.ref_logprob(batch), df.actor_logprob(batch), df.values(batch)
    batch = df.gather(df.score(batch), *pending)  # reward and cost
    batch = df.advantage(batch, "gae")  # on (reward − λ·cost) / (1 + λ)
    metrics = df.update(batch)
    df.update_lagrange(batch)
    return metrics, batch


ALGORITHMS = {"ppo": ppo, "grpo": grpo, "rloo": rloo, "remax": remax, "safe-rlhf": safe_rlhf}
