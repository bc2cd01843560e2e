"""Policy and value losses, KL penalties, the entropy bonus and Safe-RLHF's Lagrange multiplier.

Pure functions on [B, T] tensors over response tokens; every mean is a token-mean over the
response mask. Policy losses live in a small registry with one signature:

    loss_fn(logprobs, old_logprobs, advantages, mask, *, clip_ratio=0.2, clip_ratio_high=None)
        -> (loss, stats)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hybridflow.simulator.errors import HflowError

from .functional import masked_mean

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLossFn:
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise HflowError(f"unknown policy loss '{name}'; known: {', '.join(POLICY_LOSSES)}") from None


@register_policy_loss("ppo")
def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                  clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
                  **_) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate: mean over tokens of max(−A·r, −A·clip(r, 1−ε, 1+ε_high)), r = π/π_old."""
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + high)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    stats = {
        "clipfrac": masked_mean((clipped > unclipped).to(logprobs.dtype), mask).item(),
        "approx_kl": masked_mean(-log_ratio, mask).item(),
    }
    return loss, stats


@register_policy_loss("reinforce")
def reinforce_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                   **_) -> tuple[Tensor, dict[str, float]]:
    """Unclipped importance-weighted policy gradient: mean over tokens of −A·π/π_old."""
    log_ratio = logprobs - old_logprobs
    loss = masked_mean(-advantages * torch.exp(log_ratio), mask)
    return loss, {"clipfrac": 0.0, "approx_kl": masked_mean(-log_ratio, mask).item()}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL divergence"):
    k1 = log π − log π_ref; k2 = ½(log π − log π_ref)²; k3 = e^{log π_ref − log π} − (log π_ref − log π) − 1;
    abs = |log π − log π_ref|."""
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - (-d) - 1.0
    if kind == "abs":
        return d.abs()
    raise HflowError(f"unknown KL estimator '{kind}'; pick one of {', '.join(KL_ESTIMATORS)}")


def scores_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar score on its last response token."""
    m = mask.to(torch.long)
    T = m.shape[1]
    last = torch.where(m.any(-1), T - 1 - torch.flip(m, [-1]).argmax(-1), torch.zeros_like(m[:, 0]))
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(m.shape[0], device=m.device), last] = scores * m.any(-1).to(scores.dtype)
    return out


def kl_in_reward(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, beta: float,
                 kind: str = "k1") -> tuple[Tensor, float]:
    """Token rewards with the KL penalty folded in: score on the last token minus β·KL on every token.
    Returns (token_rewards, mean token KL)."""
    kl = kl_penalty(logprobs, ref_logprobs, kind) * mask.to(logprobs.dtype)
    return scores_to_token_rewards(scores, mask) - beta * kl, masked_mean(kl, mask).item()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None = 0.2) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: ½·mean over tokens of max((V − R)², (V_old + clip(V − V_old, ±c) − R)²)."""
    err = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * masked_mean(err, mask), {"vf_clipfrac": 0.0}
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    err_clipped = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask)
    return loss, {"vf_clipfrac": masked_mean((err_clipped > err).to(values.dtype), mask).item()}


def entropy_bonus(entropy: Tensor, mask: Tensor) -> Tensor:
    """Token-mean entropy of the policy; subtracted from the loss times `entropy_coef`."""
    return masked_mean(entropy, mask)


def actor_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
               policy_loss: str = "ppo", clip_ratio: float = 0.2, clip_ratio_high: float | None = None,
               entropy: Tensor | None = None, entropy_coef: float = 0.0, ref_logprobs: Tensor | None = None,
               kl_coef: float = 0.0, kl_kind: str = "k3") -> tuple[Tensor, dict[str, float]]:
    """The actor's full objective: policy loss − entropy_coef·entropy + kl_coef·KL (KL as a loss term).
    With `ref_logprobs` the stats also hold `kl`, the token-mean of log π − log π_ref (k1)."""
    loss, stats = get_policy_loss(policy_loss)(logprobs, old_logprobs, advantages, mask, clip_ratio=clip_ratio,
                                               clip_ratio_high=clip_ratio_high)
    stats["pg_loss"] = loss.item()
    if entropy is not None and entropy_coef:
        ent = entropy_bonus(entropy, mask)
        loss = loss - entropy_coef * ent
        stats["entropy"] = ent.item()
    if ref_logprobs is not None:
        stats["kl"] = masked_mean(logprobs.detach() - ref_logprobs, mask).item()
    if ref_logprobs is not None and kl_coef:
        kl = masked_mean(kl_penalty(logprobs, ref_logprobs, kl_kind), mask)
        loss = loss + kl_coef * kl
        stats["kl_loss"] = kl.item()
    return loss, stats


@dataclass
class LagrangeMultiplier:
    """Safe-RLHF's λ on the cost constraint E[cost] ≤ threshold, kept as log λ so it stays positive
    (Dai et al. 2024): the loss −(J_c − d)·λ is minimised over log λ by gradient descent, i.e.
    log λ ← log λ + lr·(J_c − d)·λ; λ is capped at `max_value`."""

    value: float = 1.0
    lr: float = 0.1
    threshold: float = 0.0
    max_value: float | None = None

    def update(self, mean_cost: float) -> float:
        log_lam = math.log(self.value) + self.lr * (mean_cost - self.threshold) * self.value
        lam = math.exp(log_lam)
        self.value = min(lam, self.max_value) if self.max_value is not None else lam
        return self.value

    def state_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "lr": self.lr, "threshold": self.threshold, "max_value": self.max_value}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.lr, self.threshold = state["value"], state["lr"], state["threshold"]
        self.max_value = state.get("max_value")
