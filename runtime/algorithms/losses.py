"""Policy and value losses, loss aggregation, KL penalties and the adaptive KL controller.

Pure functions on [B, T] tensors over response tokens. Policy losses live in a small registry with
one signature; they return per-token losses, which `aggregate` turns into one number:

    loss_fn(logprobs, old_logprobs, advantages, mask, settings: PolicyLossSettings)
        -> (per-token loss [B, T], stats)

Log-ratios are clamped to ±LOG_RATIO_CLAMP before `exp`: a ratio of inf would make a finite loss
(the clipped branch wins the max) with a NaN gradient (0 · inf through the other branch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridflow.runtime.algorithms.functional import masked, masked_mean, masked_sum
from hybridflow.simulator.algorithms.settings import KLSettings, PolicyLossSettings
from hybridflow.simulator.errors import HflowError

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
LOG_RATIO_CLAMP = 20.0


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


def aggregate(per_token: Tensor, mask: Tensor, mode: str, norm_length: int | None = None) -> Tensor:
    """One loss from per-token losses ℓ_{i,t} over the rows i of the batch and their response tokens t:

    - token-mean:               Σ_i Σ_t ℓ / Σ_i |o_i|                (DAPO's token-level loss)
    - seq-mean-token-mean:      (1/G) Σ_i (1/|o_i|) Σ_t ℓ            (the GRPO paper)
    - seq-mean-token-sum:       (1/G) Σ_i Σ_t ℓ
    - seq-mean-token-sum-norm:  (1/G) Σ_i Σ_t ℓ / L                  (Dr.GRPO: L a constant, the response budget)

    An all-masked row adds 0 and still counts among the G rows of the seq-mean modes."""
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    rows = per_token.shape[0]
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token, mask, -1).sum() / rows
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token, mask, -1).sum() / rows
    if mode == "seq-mean-token-sum-norm":
        if not norm_length:
            raise HflowError("loss aggregation seq-mean-token-sum-norm needs the response budget (norm_length)")
        return masked_sum(per_token, mask, -1).sum() / (rows * norm_length)
    raise HflowError(f"unknown loss aggregation '{mode}'; use token-mean, seq-mean-token-mean, seq-mean-token-sum "
                     "or seq-mean-token-sum-norm")


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register_policy_loss("ppo")
def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  settings: PolicyLossSettings) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate per token: max(−A·r, −A·clip(r, 1−ε, 1+ε_high)), r = π/π_old (Schulman et al.
    2017; ε_high ≠ ε is DAPO's clip-higher). With `clip_ratio_c` = c, dual-clip (Ye et al. 2020): for
    A < 0 the loss is also capped at −c·A, so a huge ratio on a bad action cannot dominate."""
    high = settings.clip_ratio if settings.clip_ratio_high is None else settings.clip_ratio_high
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - settings.clip_ratio, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clipfrac": masked_mean((clipped > unclipped).to(logprobs.dtype), mask).item(),
             "approx_kl": masked_mean(-log_ratio, mask).item()}
    if settings.clip_ratio_c is not None:
        cap = -advantages * settings.clip_ratio_c
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        stats["clipfrac_lower"] = masked_mean(capped.to(logprobs.dtype), mask).item()
    return loss, stats


@register_policy_loss("reinforce")
def reinforce_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                   settings: PolicyLossSettings) -> tuple[Tensor, dict[str, float]]:
    """Unclipped importance-weighted policy gradient per token: −A·π/π_old."""
    log_ratio = _log_ratio(logprobs, old_logprobs)
    return -advantages * torch.exp(log_ratio), {"clipfrac": 0.0, "approx_kl": masked_mean(-log_ratio, mask).item()}


@register_policy_loss("gspo")
def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              settings: PolicyLossSettings) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): the sequence-level ratio s_i = (π(y_i|x)/π_old(y_i|x))^(1/|y_i|)
    = exp((1/|y_i|) Σ_t log r_{i,t}), clipped per sequence: max(−A_i·s_i, −A_i·clip(s_i, 1−ε, 1+ε_high)),
    the same on each of the sequence's tokens (aggregate with seq-mean-token-mean for the paper's
    (1/G) Σ_i). Each token carries s_i's gradient through the GSPO-token form
    s_{i,t} = sg[s_i]·π(y_t)/sg[π(y_t)], whose value is s_i."""
    high = settings.clip_ratio if settings.clip_ratio_high is None else settings.clip_ratio_high
    token_log_ratio = _log_ratio(logprobs, old_logprobs)
    seq_log_ratio = masked_mean(token_log_ratio, mask, -1).detach()[:, None]
    log_s = (logprobs - logprobs.detach() + seq_log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1.0 - settings.clip_ratio, 1.0 + high)
    return torch.maximum(unclipped, clipped), {
        "clipfrac": masked_mean((clipped > unclipped).to(logprobs.dtype), mask).item(),
        "approx_kl": masked_mean(-token_log_ratio, mask).item()}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL divergence"),
    d = log π − log π_ref: k1 = d; k2 = ½d²; k3 = e^{−d} + d − 1; abs = |d|. As a loss term only k2 and k3
    regularise (E[∇k1] = E[∇log π] = 0); the settings refuse k1 there."""
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(-d) + d - 1.0
    if kind == "abs":
        return d.abs()
    raise HflowError(f"unknown KL estimator '{kind}'; pick one of k1, k2, k3, abs")


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
    kl = masked(kl_penalty(logprobs, ref_logprobs, kind), mask)
    return scores_to_token_rewards(scores, mask) - beta * kl, masked_mean(kl, mask).item()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None = 0.2) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: ½·mean over tokens of max((V − R)², (V_old + clip(V − V_old, ±c) − R)²);
    `vf_clipfrac` is the share of tokens where |V − V_old| > c (the clamp bites)."""
    err = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * masked_mean(err, mask), {"vf_clipfrac": 0.0}
    delta = values - old_values
    clipped = old_values + torch.clamp(delta, -clip_range, clip_range)
    loss = 0.5 * masked_mean(torch.maximum(err, (clipped - returns) ** 2), mask)
    return loss, {"vf_clipfrac": masked_mean((delta.abs() > clip_range).to(values.dtype), mask).item()}


def behaviour_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Off-policy correction for a rollout sampled by an older behaviour policy μ (one-step-off):
    the truncated importance weight of each token, detached,

        w_t = min(π_old(y_t) / μ(y_t), C) = min(exp(log π_old(y_t) − log μ(y_t)), C)

    with π_old the policy the update starts from and C = `cap` ≥ 1. It multiplies each token's
    policy-loss term, decoupled from the PPO clip (Hilton et al. 2022's decoupled objective, as
    AReaL and verl's truncated importance sampling use it): the PPO ratio r_t = π_θ / π_old keeps
    its own clip to [1 − ε, 1 + ε]; w only re-weights. Since w_t ≥ 0, w_t·min(r_t·A_t, clip(r_t)·A_t)
    = min(r_t·(w_t·A_t), clip(r_t)·(w_t·A_t)): weighting the term is weighting the advantage."""
    log_w = (old_logprobs - behaviour_logprobs).detach().clamp(max=LOG_RATIO_CLAMP)
    return torch.exp(log_w).clamp(max=cap)


def actor_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               settings: PolicyLossSettings, *, norm_length: int | None = None, entropy: Tensor | None = None,
               ref_logprobs: Tensor | None = None, kl: KLSettings | None = None,
               behaviour_logprobs: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The actor's objective: policy loss − entropy_coef·entropy (+ β·KL when `kl` puts it in the loss),
    each aggregated as `settings.aggregation` says. With `ref_logprobs` the stats also hold `kl`, the
    token-mean of log π − log π_ref (k1). With `behaviour_logprobs` (an off-policy rollout) each
    token's policy term is weighted by `behaviour_weights` (stats: their mean, the share capped)."""
    offpolicy: dict[str, float] = {}
    if behaviour_logprobs is not None:
        w = behaviour_weights(old_logprobs, behaviour_logprobs, settings.behaviour_weight_cap)
        advantages = advantages * w
        offpolicy = {"is_weight_mean": masked_mean(w, mask).item(),
                     "is_weight_capped": masked_mean((w >= settings.behaviour_weight_cap).float(), mask).item()}
    per_token, stats = get_policy_loss(settings.kind)(logprobs, old_logprobs, advantages, mask, settings)
    stats.update(offpolicy)
    loss = aggregate(per_token, mask, settings.aggregation, norm_length)
    stats["pg_loss"] = loss.item()
    if entropy is not None and settings.entropy_coef:
        ent = aggregate(entropy, mask, settings.aggregation, norm_length)
        loss = loss - settings.entropy_coef * ent
        stats["entropy"] = ent.item()
    if ref_logprobs is not None:
        stats["kl"] = masked_mean(logprobs.detach() - ref_logprobs, mask).item()
    if ref_logprobs is not None and kl is not None and kl.placement == "loss" and kl.coef:
        term = aggregate(kl_penalty(logprobs, ref_logprobs, kl.estimator), mask, settings.aggregation, norm_length)
        loss = loss + kl.coef * term
        stats["kl_loss"] = term.item()
    return loss, stats


class KLController:
    """β of a KL penalty in the reward: fixed, or with `target` set adaptive (Ziegler et al. 2019):
    β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n/horizon) after n sequences at mean KL."""

    def __init__(self, settings: KLSettings):
        self.value, self.target, self.horizon = settings.coef, settings.target, settings.horizon

    def update(self, kl: float, n: int) -> float:
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
