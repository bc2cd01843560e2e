"""Policy/value losses, aggregation, KL estimators and the KL controller against hand-computed values from
their papers' formulas, and the numerical guards (log-ratio clamp, where-masking)."""

import math

import pytest
import torch

from hybridflow.runtime.algorithms.losses import (
    KLController,
    actor_loss,
    aggregate,
    get_policy_loss,
    kl_in_reward,
    kl_penalty,
    scores_to_token_rewards,
    value_loss,
)
from hybridflow.simulator.algorithms.settings import KLSettings, PolicyLossSettings
from hybridflow.simulator.errors import HflowError

T = torch.tensor
PPO = PolicyLossSettings()


def ratios(*r):
    return torch.log(T([list(r)]))


def test_ppo_clip_by_hand():
    # r = 1.5, .5, 1.1; A = 1, −1, 2; ε = .2:
    #   max(−1.5, −1.2) = −1.2 (clipped); max(.5, .8) = .8 (clipped); max(−2.2, −2.2) = −2.2.
    logp = ratios(1.5, 0.5, 1.1).requires_grad_()
    loss, stats = actor_loss(logp, torch.zeros(1, 3), T([[1.0, -1.0, 2.0]]), torch.ones(1, 3), PPO)
    assert loss.item() == pytest.approx(-2.6 / 3, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(2 / 3)
    assert stats["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3, abs=1e-6)
    loss.backward()
    # Clipped tokens carry no gradient; the last one: d/dlogp (−A·e^logp)/3 = −2·1.1/3.
    assert logp.grad[0, :2].abs().max().item() == 0
    assert logp.grad[0, 2].item() == pytest.approx(-2 * 1.1 / 3, abs=1e-6)


def test_ppo_token_mean_over_mask_and_clip_higher():
    adv = T([[1.0, -1.0, 2.0]])
    loss, _ = actor_loss(ratios(1.5, 0.5, 1.1), torch.zeros(1, 3), adv, T([[1, 1, 0]]), PPO)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    # ε_high = .6 (DAPO's clip-higher): r = 1.5 is inside [.8, 1.6] → −1.5.
    loss, _ = actor_loss(ratios(1.5, 0.5, 1.1), torch.zeros(1, 3), adv, torch.ones(1, 3),
                         PolicyLossSettings(clip_ratio_high=0.6))
    assert loss.item() == pytest.approx(-2.9 / 3, abs=1e-6)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # r = 5, A = −1: max(5, 1.2) = 5, capped at −c·A = 3; r = 5, A = +1: max(−5, −1.2) = −1.2 (no cap).
    per_token, stats = get_policy_loss("ppo")(ratios(5.0, 5.0), torch.zeros(1, 2), T([[-1.0, 1.0]]),
                                              torch.ones(1, 2), PolicyLossSettings(clip_ratio_c=3.0))
    assert per_token[0].tolist() == pytest.approx([3.0, -1.2], abs=1e-6)
    assert stats["clipfrac_lower"] == pytest.approx(0.5)
    plain, _ = get_policy_loss("ppo")(ratios(5.0), torch.zeros(1, 1), T([[-1.0]]), torch.ones(1, 1), PPO)
    assert plain.item() == pytest.approx(5.0, abs=1e-5)
    with pytest.raises(ValueError):
        PolicyLossSettings(clip_ratio_c=0.5)  # c must exceed 1


def test_reinforce_is_unclipped():
    per_token, _ = get_policy_loss("reinforce")(ratios(1.5, 0.5), torch.zeros(1, 2), T([[1.0, -1.0]]),
                                                torch.ones(1, 2), PPO)
    assert per_token[0].tolist() == pytest.approx([-1.5, 0.5], abs=1e-6)
    with pytest.raises(HflowError, match="unknown policy loss 'dpo'"):
        get_policy_loss("dpo")


def test_gspo_sequence_ratio_and_its_gradient():
    # Row 0: log-ratios log 2, log .5, 0 → s = (2·.5·1)^(1/3) = 1 → −A on each token. Row 1: log 1.21 and 0
    # over 2 tokens → s = 1.21^(1/2) = 1.1, inside [.8, 1.2]: −1.1 per token (A = 1). Seq-mean-token-mean:
    # (−1 − 1.1)/2; d/dlogp_t of row 1 = −A·s/|y|/G = −1.1/2/2 (the gradient of −A·s_i).
    logp = torch.log(T([[2.0, 0.5, 1.0], [1.21, 1.0, 7.0]])).requires_grad_()
    mask = T([[1, 1, 1], [1, 1, 0]])
    settings = PolicyLossSettings(kind="gspo", clip_ratio=0.2, aggregation="seq-mean-token-mean")
    loss, stats = actor_loss(logp, torch.zeros(2, 3), T([[1.0] * 3, [1.0] * 3]), mask, settings)
    assert loss.item() == pytest.approx((-1.0 - 1.1) / 2, abs=1e-6) and stats["clipfrac"] == 0.0
    loss.backward()
    assert logp.grad[1, :2].tolist() == pytest.approx([-1.1 / 4] * 2, abs=1e-6)
    assert logp.grad[1, 2].item() == 0.0  # padding
    # GSPO's tight ε: s = 1.1 is clipped at 1 + 4e-4 → −1.0004 and no gradient.
    tight, _ = get_policy_loss("gspo")(torch.log(T([[1.21, 1.0]])), torch.zeros(1, 2), torch.ones(1, 2),
                                       torch.ones(1, 2), PolicyLossSettings(kind="gspo", clip_ratio=3e-4,
                                                                            clip_ratio_high=4e-4))
    assert tight[0].tolist() == pytest.approx([-1.0004, -1.0004], abs=1e-6)


def test_aggregation_modes_by_hand_with_an_empty_row_and_a_one_token_row():
    # losses [1, 2, 3 | 4, –, – | –, –, –]: token-mean 10/4; seq-mean-token-mean (2 + 4 + 0)/3;
    # seq-mean-token-sum (6 + 4 + 0)/3; Dr.GRPO's constant normaliser (6 + 4 + 0)/(3·8).
    x = T([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0], [float("inf"), 0.0, 0.0]])
    m = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate(x, m, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate(x, m, "seq-mean-token-sum").item() == pytest.approx(10 / 3)
    assert aggregate(x, m, "seq-mean-token-sum-norm", norm_length=8).item() == pytest.approx(10 / 24)
    with pytest.raises(HflowError, match="norm_length"):
        aggregate(x, m, "seq-mean-token-sum-norm")


def test_nan_at_padding_and_a_huge_log_ratio_give_finite_gradients():
    # Padding holds NaN log-probs; a real token's log-ratio is 200 with A > 0: exp would be inf and the
    # clipped branch's max would hide it in the loss but not in the gradient (0·inf = NaN).
    logp = T([[200.0, float("nan")]]).requires_grad_()
    loss, _ = actor_loss(logp, torch.zeros(1, 2), T([[1.0, 1.0]]), T([[1, 0]]), PPO)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()


def test_value_loss_clipped_by_hand():
    # tok0: (1−.8)² = .04 vs (.7−.8)² = .01 → .04; tok1: 0 vs (.3−0)² = .09 → .09; ½·mean = .0325.
    # |V − V_old| = .5 > .2 on both tokens: clipfrac 1.
    loss, stats = value_loss(T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[0.8, 0.0]]), torch.ones(1, 2), clip_range=0.2)
    assert loss.item() == pytest.approx(0.0325, abs=1e-7)
    assert stats["vf_clipfrac"] == pytest.approx(1.0)
    loss, _ = value_loss(T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[0.8, 0.0]]), torch.ones(1, 2), clip_range=None)
    assert loss.item() == pytest.approx(0.5 * 0.04 / 2, abs=1e-7)


def test_vf_clipfrac_counts_only_tokens_the_clamp_bites():
    # V − V_old = .1 (inside ±.2, but old + (V − old) ≠ V in float) and .3 (clipped): 1 of 2.
    values, old = T([[0.3, 0.7]]), T([[0.2, 0.4]])
    _, stats = value_loss(values, old, T([[1.0, 1.0]]), torch.ones(1, 2), clip_range=0.2)
    assert stats["vf_clipfrac"] == pytest.approx(0.5)


def test_kl_estimators_by_hand():
    # log π − log π_ref = log 2: k1 = .693147, k2 = ½·log²2 = .240227, k3 = ½ + log 2 − 1 = .193147.
    lp, ref = torch.log(T([0.5])), torch.log(T([0.25]))
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(HflowError, match="pick one of k1, k2, k3, abs"):
        kl_penalty(lp, ref, "k9")


def test_kl_loss_gradients_k1_is_zero_k2_and_k3_regularise():
    # Tokens drawn from π = softmax(θ) over 4 choices, π_ref uniform. As loss terms, E[∇k1] = E[∇log π] = 0;
    # E[∇k2] = ∇KL(π‖π_ref); E[∇k3] = ∇KL(π_ref‖π). Monte Carlo over 200k samples vs the exact gradients.
    g = torch.Generator().manual_seed(0)
    theta = T([1.0, 0.0, -0.5, 0.3], dtype=torch.float64)
    ref = torch.full((4,), 0.25, dtype=torch.float64).log()
    x = torch.multinomial(torch.softmax(theta, 0), 200_000, replacement=True, generator=g)

    def grad(fn):
        t = theta.clone().requires_grad_()
        fn(t).backward()
        return t.grad

    def mc(kind):
        return grad(lambda t: kl_penalty(torch.log_softmax(t, 0)[x], ref[x], kind).mean())

    exact_fwd = grad(lambda t: (torch.softmax(t, 0) * (torch.log_softmax(t, 0) - ref)).sum())
    exact_rev = grad(lambda t: (ref.exp() * (ref - torch.log_softmax(t, 0))).sum())
    assert mc("k1").abs().max() < 1e-2 < exact_fwd.abs().max()
    torch.testing.assert_close(mc("k2"), exact_fwd, atol=1e-2, rtol=0)
    torch.testing.assert_close(mc("k3"), exact_rev, atol=1e-2, rtol=0)


def test_a_kl_loss_term_with_k1_is_refused_in_one_line():
    with pytest.raises(ValueError, match="estimator k1 does not regularise"):
        KLSettings(placement="loss", estimator="k1")
    KLSettings(placement="loss")  # partial: the algorithm's estimator completes it (settings.merge_settings)


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


def test_actor_loss_with_entropy_bonus_and_k3_kl_term():
    # r = 1, A = 1 → pg = −1; entropy mean 1 × .1; k3 at d = log 2: ½ + log 2 − 1, × .5.
    lp = T([[-1.0, -2.0]])
    loss, stats = actor_loss(lp, lp.clone(), torch.ones(1, 2), torch.ones(1, 2), PolicyLossSettings(entropy_coef=0.1),
                             entropy=T([[0.5, 1.5]]), ref_logprobs=lp - math.log(2),
                             kl=KLSettings(coef=0.5, placement="loss", estimator="k3"))
    k3 = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx(-1 - 0.1 + 0.5 * k3, abs=1e-6)
    assert stats["pg_loss"] == pytest.approx(-1.0) and stats["entropy"] == pytest.approx(1.0)
    assert stats["kl_loss"] == pytest.approx(k3, abs=1e-6) and stats["kl"] == pytest.approx(math.log(2), abs=1e-6)
    # A KL placed in the reward adds nothing to the loss (only the statistic).
    in_reward, stats = actor_loss(lp, lp.clone(), torch.ones(1, 2), torch.ones(1, 2), PPO,
                                  ref_logprobs=lp - math.log(2), kl=KLSettings(coef=0.5))
    assert in_reward.item() == pytest.approx(-1.0) and "kl_loss" not in stats


def test_adaptive_kl_controller_by_hand():
    # β = .1, target 1, KL 2 → error clipped to .2; 100 sequences over a horizon of 1000: β·(1 + .02) = .102.
    ctl = KLController(KLSettings(coef=0.1, target=1.0, horizon=1000))
    assert ctl.update(2.0, 100) == pytest.approx(0.102)
    assert ctl.update(0.95, 1000) == pytest.approx(0.102 * 0.95)  # error −.05
    fixed = KLController(KLSettings(coef=0.1))
    assert fixed.update(5.0, 100) == 0.1
    restored = KLController(KLSettings())
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
