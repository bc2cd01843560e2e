"""A critic-free update on conversation batches in one process (no Ray): the example's and the tests'
trainer for tool use, built from the runtime's own losses and advantage estimators.

The batch is conversation.py's: `response_mask` marks generated tokens only, so the advantage
estimator's outcome and token placement, the policy loss's token mean, the KL's mean and the entropy
all skip tool results, observations and template scaffolding; `rollout_log_probs` (the sampler's, on
generated tokens) are the old log-probs of the single on-policy step. Any registered advantage
estimator that needs no critic or greedy baseline (grpo, rloo, reinforce++, reinforce++-baseline) and
any policy loss (ppo, reinforce, gspo) runs as is.
"""

from __future__ import annotations

import torch

from hybridflow.runtime.algorithms.advantages import get_advantage_estimator
from hybridflow.runtime.algorithms.functional import masked_mean
from hybridflow.runtime.algorithms.losses import actor_loss, kl_penalty, scores_to_token_rewards
from hybridflow.runtime.engines.train.logits import token_log_probs
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, PolicyLossSettings


def response_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """log π(token) at every response column from one forward over the whole conversation [B, R]."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    width = batch["responses"].shape[1]
    return token_log_probs(logits.float() / (temperature or 1.0), batch["input_ids"])[:, -width:]


def conversation_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                        scores: torch.Tensor | None, *, group_size: int, advantage: AdvantageSettings,
                        loss: PolicyLossSettings, kl: KLSettings | None = None,
                        ref_model: torch.nn.Module | None = None, temperature: float = 1.0,
                        grad_clip: float = 1.0) -> dict[str, float]:
    """One optimizer step on a batch of conversations: the batch's `token_rewards` (an environment's
    per-turn rewards) plus `scores` [B] (a task's final reward; None: none) on each last generated
    token. Returns the step's statistics."""
    mask = batch["response_mask"]
    token_rewards = batch.get("token_rewards", torch.zeros(mask.shape))  # an environment's, per turn
    if scores is not None:
        token_rewards = token_rewards + scores_to_token_rewards(scores.float(), mask)
    adv, _ = get_advantage_estimator(advantage.estimator)(token_rewards, mask, advantage, group_size=group_size)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref = response_log_probs(ref_model, batch, temperature)
    logprobs = response_log_probs(model, batch, temperature)
    value, stats = actor_loss(logprobs, batch["rollout_log_probs"], adv, mask, loss, ref_logprobs=ref, kl=kl)
    optimizer.zero_grad()
    value.backward()
    stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    optimizer.step()
    if ref is not None:
        stats["kl_k3"] = float(masked_mean(kl_penalty(logprobs.detach(), ref, "k3"), mask))
    stats["advantage_mean"] = float(masked_mean(adv, mask))
    return stats
