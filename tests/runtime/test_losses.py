"""Policy/value losses, KL estimators, entropy and the Lagrange multiplier against hand-computed values."""

import math

import pytest
import torch

from hybridflow.runtime.algorithms.losses import (
    LagrangeMultiplier,
    actor_loss,
    get_policy_loss,
    kl_in_reward,
    kl_penalty,
    scores_to_token_rewards,
    value_loss,
)
from hybridflow.simulator.errors import HflowError

T = torch.tensor


def ratios(*r):
    return torch.log(T([list(r)]))


def test_ppo_clip_by_hand():
    # r = 1.5, .5, 1.1; A = 1, −1, 2; ε = .2:
    #   max(−1.5, −1.2) = −1.2 (clipped); max(.5, .8) = .8 (clipped); max(−2.2, −2.2) = −2.2.
    logp = ratios(1.5, 0.5, 1.1).requires_grad_()
    loss, stats = get_policy_loss("ppo")(logp, torch.zeros(1, 3), T([[1.0, -1.0, 2.0]]), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-2.6 / 3, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(2 / 3)
    assert stats["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3, abs=1e-6)
    loss.backward()
    # Clipped tokens carry no gradient; the last one: d/dlogp (−A·e^logp)/3 = −2·1.1/3.
    assert logp.grad[0, :2].abs().max().item() == 0
    assert logp.grad[0, 2].item() == pytest.approx(-2 * 1.1 / 3, abs=1e-6)


def test_ppo_token_mean_over_mask_and_asymmetric_clip():
    adv = T([[1.0, -1.0, 2.0]])
    loss, _ = get_policy_loss("ppo")(ratios(1.5, 0.5, 1.1), torch.zeros(1, 3), adv, T([[1, 1, 0]]))
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    # ε_high = .6: r = 1.5 is inside [.8, 1.6] → −1.5.
    loss, _ = get_policy_loss("ppo")(ratios(1.5, 0.5, 1.1), torch.zeros(1, 3), adv, torch.ones(1, 3),
                                     clip_ratio_high=0.6)
    assert loss.item() == pytest.approx(-2.9 / 3, abs=1e-6)


def test_reinforce_is_unclipped():
    loss, _ = get_policy_loss("reinforce")(ratios(1.5, 0.5), torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((-1.5 + 0.5) / 2, abs=1e-6)
    with pytest.raises(HflowError, match="unknown policy loss 'dpo'"):
        get_policy_loss("dpo")


def test_value_loss_clipped_by_hand():
    # tok0: (1−.8)² = .04 vs (.7−.8)² = .01 → .04; tok1: 0 vs (.3−0)² = .09 → .09; ½·mean = .0325.
    loss, stats = value_loss(T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[0.8, 0.0]]), torch.ones(1, 2), clip_range=0.2)
    assert loss.item() == pytest.approx(0.0325, abs=1e-7)
    assert stats["vf_clipfrac"] == pytest.approx(0.5)
    loss, _ = value_loss(T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[0.8, 0.0]]), torch.ones(1, 2), clip_range=None)
    assert loss.item() == pytest.approx(0.5 * 0.04 / 2, abs=1e-7)


def test_kl_estimators_by_hand():
    # log π − log π_ref = log 2: k1 = .693147, k2 = ½·log²2 = .240227, k3 = ½ + log 2 − 1 = .193147.
    lp, ref = torch.log(T([0.5])), torch.log(T([0.25]))
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(HflowError, match="pick one of k1, k2, k3, abs"):
        kl_penalty(lp, ref, "k9")


def test_scores_land_on_last_response_token():
    out = scores_to_token_rewards(T([1.0, 2.0, 3.0]), T([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]))
    assert out.tolist() == [[0, 0, 1.0, 0], [2.0, 0, 0, 0], [0, 0, 0, 0]]


def test_kl_in_reward_by_hand():
    # KL .1 per token, β = .5 → −.05 on every response token, the score added on the last one.
    mask = T([[1, 1, 0], [1, 1, 1]])
    lp = torch.full((2, 3), -1.0)
    rewards, kl = kl_in_reward(T([1.0, 2.0]), lp, lp - 0.1, mask, beta=0.5, kind="k1")
    assert torch.allclose(rewards, T([[-0.05, 0.95, 0.0], [-0.05, -0.05, 1.95]]), atol=1e-6)
    assert kl == pytest.approx(0.1, abs=1e-6)


def test_actor_loss_with_entropy_bonus_and_kl_term():
    # r = 1, A = 1 → pg = −1; entropy mean 1 × .1; KL k1 log 2 × .5 → −1 − .1 + .346574.
    lp = T([[-1.0, -2.0]])
    loss, stats = actor_loss(lp, lp.clone(), torch.ones(1, 2), torch.ones(1, 2), entropy=T([[0.5, 1.5]]),
                             entropy_coef=0.1, ref_logprobs=lp - math.log(2), kl_coef=0.5, kl_kind="k1")
    assert loss.item() == pytest.approx(-1 - 0.1 + 0.5 * math.log(2), abs=1e-6)
    assert stats["pg_loss"] == pytest.approx(-1.0) and stats["entropy"] == pytest.approx(1.0)
    assert stats["kl_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_lagrange_multiplier_by_hand():
    # log λ: 0 + .1·(2 − 0)·1 = .2 → e^.2 = 1.221403; then .2 + .1·(−1)·1.221403 = .0778597 → 1.080971.
    lam = LagrangeMultiplier(value=1.0, lr=0.1, threshold=0.0)
    assert lam.update(2.0) == pytest.approx(math.exp(0.2), abs=1e-9)
    assert lam.update(-1.0) == pytest.approx(math.exp(0.2 - 0.1 * math.exp(0.2)), abs=1e-9)
    capped = LagrangeMultiplier(value=1.0, lr=1.0, threshold=0.5, max_value=1.1)
    assert capped.update(1.5) == 1.1  # e^1 > 1.1
    restored = LagrangeMultiplier()
    restored.load_state_dict(lam.state_dict())
    assert restored == lam
