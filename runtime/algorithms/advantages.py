"""Advantage estimators: token-level advantages (and returns) from token-level rewards.

Every estimator takes the same arguments so a driver can pick one by name:

    estimator(token_rewards [B, T], mask [B, T], settings: AdvantageSettings, *, values=None,
              group_size=1, baseline=None) -> (advantages [B, T], returns [B, T])

`token_rewards` is the per-token reward of the response (the scalar score on the last response
token, minus the KL penalty on every token when the KL goes in the reward). `mask` is 1 on
response tokens and 0 on padding. Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) use each
sequence's summed reward. Group estimators expect the `group_size` samples of one prompt to be
consecutive rows (the order `repeat_interleave` gives). Outputs are zero where the mask is zero.
A reward that is NaN or infinite is a clear error, never a NaN in the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridflow.runtime.algorithms.functional import masked, masked_sum, masked_whiten
from hybridflow.simulator.algorithms.settings import AdvantageSettings
from hybridflow.simulator.errors import HflowError

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
EPS = 1e-6  # keeps a group whose rewards are all equal at zero advantage (0 / (0 + EPS))


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


def check_finite(token_rewards: Tensor, mask: Tensor, what: str = "reward") -> None:
    bad = ~torch.isfinite(masked(token_rewards, mask)).all(-1)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise HflowError(f"the {what} of sample(s) {rows[:5]} is NaN or infinite; make the reward function or model "
                         "return finite numbers")


def _groups(scores: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or scores.numel() % group_size:
        raise HflowError(f"batch of {scores.numel()} sequences does not split into groups of {group_size}; "
                         f"pass a batch that is a multiple of samples_per_prompt")
    return scores.view(-1, group_size)


def _outcome(token_rewards: Tensor, mask: Tensor) -> Tensor:
    check_finite(token_rewards, mask)
    return masked_sum(token_rewards, mask, -1)


def _on_tokens(per_sequence: Tensor, mask: Tensor) -> Tensor:
    return masked(per_sequence.reshape(-1, 1).expand(mask.shape), mask)


@register_advantage("gae")
def gae_advantages(token_rewards: Tensor, mask: Tensor, settings: AdvantageSettings, *, values: Tensor | None = None,
                   **_) -> tuple[Tensor, Tensor]:
    """PPO's generalised advantage estimation over response tokens (Schulman et al. 2016).

    δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, returns = A + V (before whitening);
    the value after the last response token is 0. Padding inside a row is skipped: the
    recursion carries over masked positions unchanged. `whiten`: A whitened over the batch.
    """
    if values is None:
        raise HflowError("GAE needs the critic's values; use a plan with a critic or pick a critic-free algorithm")
    check_finite(token_rewards, mask)
    gamma, lam = settings.gamma, settings.lam
    m_all = mask.bool()
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(B, dtype=token_rewards.dtype, device=token_rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        m = m_all[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        # Masked positions pass the next step's value and advantage through untouched.
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = masked(adv + values, mask)
    return (masked_whiten(adv, mask) if settings.whiten else adv), returns


@register_advantage("grpo")
def grpo_advantages(token_rewards: Tensor, mask: Tensor, settings: AdvantageSettings, *, group_size: int = 1,
                    **_) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): Â_i = (r_i − mean(r_group)) / (std(r_group) + ε), the same on every token.
    The std is the unbiased one (torch.std); a group of one has mean 0 and std 1; a group whose
    rewards are all equal gets 0. `normalize_std` False is Dr.GRPO's Â_i = r_i − mean(r_group)."""
    g = _groups(_outcome(token_rewards, mask), group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(g), torch.ones_like(g)
    else:
        mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True)
    norm = (g - mean) / (std + EPS) if settings.normalize_std else g - mean
    adv = _on_tokens(norm, mask)
    return adv, adv


@register_advantage("rloo")
def rloo_advantages(token_rewards: Tensor, mask: Tensor, settings: AdvantageSettings, *, group_size: int = 2,
                    **_) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): Â_i = r_i − (1/(k−1))·Σ_{j≠i} r_j over the k samples of a prompt."""
    if group_size < 2:
        raise HflowError("RLOO needs samples_per_prompt >= 2 (the leave-one-out baseline needs another sample)")
    g = _groups(_outcome(token_rewards, mask), group_size)
    others = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    adv = _on_tokens(g - others, mask)
    return adv, adv


@register_advantage("remax")
def remax_advantages(token_rewards: Tensor, mask: Tensor, settings: AdvantageSettings, *,
                     baseline: Tensor | None = None, **_) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2024): Â_t = Σ_{k≥t} r_k − r(ȳ), the reward-to-go minus the reward of the greedy
    response ȳ to the same prompt (`baseline`, one scalar per row)."""
    if baseline is None:
        raise HflowError("ReMax needs the greedy rollout's reward as the baseline (generate_baseline)")
    check_finite(token_rewards, mask)
    check_finite(baseline.reshape(-1, 1), torch.ones_like(baseline.reshape(-1, 1)), "greedy baseline's reward")
    to_go = torch.flip(torch.cumsum(torch.flip(masked(token_rewards, mask), [-1]), -1), [-1])
    returns = masked(to_go, mask)
    adv = masked(to_go - baseline.reshape(-1, 1).to(to_go.dtype), mask)
    return adv, returns


@register_advantage("reinforce++")
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, settings: AdvantageSettings,
                            **_) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): G_t = Σ_{k≥t} γ^{k−t}·r_k (the token rewards carry the −β·KL_k penalty),
    Â = (G − mean(G)) / std(G) over every response token of the batch (global whitening)."""
    check_finite(token_rewards, mask)
    m = mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        g = token_rewards[:, t] + settings.gamma * running
        returns[:, t] = torch.where(m[:, t], g, 0.0)
        running = torch.where(m[:, t], g, running)
    return (masked_whiten(returns, mask) if settings.whiten else returns), returns


@register_advantage("reinforce++-baseline")
def reinforce_pp_baseline_advantages(token_rewards: Tensor, mask: Tensor, settings: AdvantageSettings, *,
                                     group_size: int = 1, **_) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): Ã_i = r_i − mean(r_group), Â_i = Ã_i / (std(Ã over the batch) + ε)
    on every token (unbiased std over the batch's sequences; `whiten` False keeps Ã)."""
    g = _groups(_outcome(token_rewards, mask), group_size)
    centred = (g - g.mean(-1, keepdim=True)).reshape(-1)
    if settings.whiten and centred.numel() > 1:
        centred = centred / (centred.std() + EPS)
    adv = _on_tokens(centred, mask)
    return adv, adv


def overlong_penalty(lengths: torch.Tensor, budget: int, buffer: float, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) with L_max = `budget` and L_cache =
    `buffer`·budget: 0 up to L_max − L_cache, then ((L_max − L_cache) − |y|) / L_cache down to −1 at
    L_max (times `penalty`). Responses stop at the budget here, so the −1 beyond it never applies."""
    cache = buffer * budget
    return penalty * ((budget - cache - lengths.float()) / cache).clamp(-1.0, 0.0)
