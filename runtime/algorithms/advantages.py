"""Advantage estimators: token-level advantages (and returns) from token-level rewards.

Every estimator takes the same arguments so a driver can pick one by name:

    estimator(token_rewards [B, T], mask [B, T], *, values=None, group_size=1, baseline=None,
              gamma=1.0, lam=1.0) -> (advantages [B, T], returns [B, T])

`token_rewards` is the per-token reward of the response (the scalar score on the last response
token, minus the KL penalty on every token when the KL goes in the reward). `mask` is 1 on
response tokens and 0 on padding. Outcome estimators (GRPO, RLOO) use each sequence's summed
reward. Group estimators expect the `group_size` samples of one prompt to be consecutive rows
(the order `repeat_interleave` gives). Outputs are zero where the mask is zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridflow.simulator.errors import HflowError

from .functional import masked_whiten

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def wrap(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def get_advantage_estimator(name: str) -> AdvantageFn:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise HflowError(f"unknown advantage estimator '{name}'; known: {', '.join(ADVANTAGE_ESTIMATORS)}") from None


def _groups(scores: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or scores.numel() % group_size:
        raise HflowError(f"batch of {scores.numel()} sequences does not split into groups of {group_size}; "
                         f"pass a batch that is a multiple of samples_per_prompt")
    return scores.view(-1, group_size)


@register_advantage("gae")
def gae_advantages(token_rewards: Tensor, mask: Tensor, *, values: Tensor | None = None, gamma: float = 1.0,
                   lam: float = 1.0, whiten: bool = True, **_) -> tuple[Tensor, Tensor]:
    """PPO's generalised advantage estimation over response tokens (Schulman et al. 2016).

    δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, returns = A + V (before whitening);
    the value after the last response token is 0. Padding inside a row is skipped: the
    recursion carries over masked positions unchanged.
    """
    if values is None:
        raise HflowError("GAE needs the critic's values; use a plan with a critic or pick grpo/rloo/remax")
    mask = mask.to(token_rewards.dtype)
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m
        # Masked positions pass the next step's value and advantage through untouched.
        next_value = m * values[:, t] + (1 - m) * next_value
        next_adv = m * a + (1 - m) * next_adv
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


@register_advantage("grpo")
def grpo_advantages(token_rewards: Tensor, mask: Tensor, *, group_size: int = 1, eps: float = 1e-6,
                    normalize_std: bool = True, **_) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): (score − group mean) / (group std + eps), the same on every token.
    The std is the unbiased one (torch.std); a group of one has mean 0 and std 1."""
    mask = mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)
    g = _groups(scores, group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(g), torch.ones_like(g)
    else:
        mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True)
    norm = (g - mean) / (std + eps) if normalize_std else g - mean
    adv = norm.reshape(-1, 1) * mask
    return adv, adv


@register_advantage("rloo")
def rloo_advantages(token_rewards: Tensor, mask: Tensor, *, group_size: int = 2, **_) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): each sample's score minus the mean of the other samples of its prompt."""
    if group_size < 2:
        raise HflowError("RLOO needs samples_per_prompt >= 2 (the leave-one-out baseline needs another sample)")
    mask = mask.to(token_rewards.dtype)
    g = _groups((token_rewards * mask).sum(-1), group_size)
    others = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    adv = (g - others).reshape(-1, 1) * mask
    return adv, adv


@register_advantage("remax")
def remax_advantages(token_rewards: Tensor, mask: Tensor, *, baseline: Tensor | None = None,
                     **_) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2024): the reward-to-go of each token minus the reward of the greedy response
    to the same prompt (`baseline`, one scalar per row)."""
    if baseline is None:
        raise HflowError("ReMax needs the greedy rollout's reward as the baseline (generate_baseline)")
    mask = mask.to(token_rewards.dtype)
    to_go = torch.flip(torch.cumsum(torch.flip(token_rewards * mask, [-1]), -1), [-1])
    returns = to_go * mask
    adv = (to_go - baseline.reshape(-1, 1).to(to_go.dtype)) * mask
    return adv, returns


def safe_rlhf_advantages(reward_adv: Tensor, cost_adv: Tensor, lagrange: float, mask: Tensor) -> Tensor:
    """Safe-RLHF (Dai et al. 2024): the policy follows (A_r − λ·A_c) / (1 + λ)."""
    return (reward_adv - lagrange * cost_adv) / (1.0 + lagrange) * mask.to(reward_adv.dtype)
