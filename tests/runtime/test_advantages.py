"""Advantage estimators against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from hybridflow.runtime.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    safe_rlhf_advantages,
)
from hybridflow.runtime.algorithms.functional import masked_mean, masked_whiten
from hybridflow.simulator.errors import HflowError

T = torch.tensor


def close(a, b, tol=1e-6):
    assert torch.allclose(a.float(), T(b).float(), atol=tol), f"{a} != {b}"


def test_registry_has_the_five_algorithms_estimators():
    assert {"gae", "grpo", "rloo", "remax"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(HflowError, match="unknown advantage estimator 'vtrace'; known: gae"):
        get_advantage_estimator("vtrace")


def test_gae_gamma_one_lambda_one():
    # δ2 = 1 − .7 = .3; δ1 = 0 + .7 − .6 = .1; δ0 = .6 − .5 = .1 → A = [.5, .4, .3]; R = A + V = 1.
    adv, ret = get_advantage_estimator("gae")(T([[0.0, 0.0, 1.0]]), T([[1, 1, 1]]), values=T([[0.5, 0.6, 0.7]]),
                                              gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted():
    # γ=.9, λ=.5: δ2=.3, A2=.3; δ1=.9·.7−.6=.03, A1=.03+.45·.3=.165; δ0=.9·.6−.5=.04, A0=.04+.45·.165=.11425.
    adv, ret = get_advantage_estimator("gae")(T([[0.0, 0.0, 1.0]]), T([[1, 1, 1]]), values=T([[0.5, 0.6, 0.7]]),
                                              gamma=0.9, lam=0.5, whiten=False)
    close(adv, [[0.11425, 0.165, 0.3]])
    close(ret, [[0.61425, 0.765, 1.0]])


def test_gae_skips_padding():
    # Row with a padded last token (value 9 must not leak): δ1 = 1 − .4 = .6; δ0 = .4 − .2 = .2 → A = [.8, .6, 0].
    adv, ret = get_advantage_estimator("gae")(T([[0.0, 1.0, 0.0]]), T([[1, 1, 0]]), values=T([[0.2, 0.4, 9.0]]),
                                              gamma=1.0, lam=1.0, whiten=False)
    close(adv, [[0.8, 0.6, 0.0]])
    close(ret, [[1.0, 1.0, 0.0]])


def test_gae_whitened_has_zero_mean_unit_variance_on_response_tokens():
    adv, _ = get_advantage_estimator("gae")(T([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]), T([[1, 1, 0], [1, 1, 1]]),
                                            values=T([[0.2, 0.4, 9.0], [0.1, 0.1, 0.1]]))
    m = T([[1, 1, 0], [1, 1, 1]])
    assert adv[0, 2] == 0
    assert abs(masked_mean(adv, m).item()) < 1e-6
    assert abs(masked_mean(adv**2, m).item() * 5 / 4 - 1) < 1e-5  # unbiased variance 1


def test_masked_whiten_by_hand():
    # mean 2, unbiased var (1 + 0 + 1)/2 = 1 → [−1, 0, 1, 0].
    close(masked_whiten(T([[1.0, 2.0, 3.0, 50.0]]), T([[1, 1, 1, 0]])), [[-1.0, 0.0, 1.0, 0.0]], 1e-5)


def test_gae_without_values_says_what_to_do():
    with pytest.raises(HflowError, match="critic"):
        get_advantage_estimator("gae")(T([[1.0]]), T([[1]]))


def test_grpo_group_normalised():
    # groups (1, 0) and (.5, .5): mean .5, unbiased std √.5 → ±.5/.70711 = ±.70711; second group std 0 → 0.
    rewards = T([[0.0, 1.0], [0.0, 0.0], [0.5, 0.0], [0.0, 0.5]])
    mask = T([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, ret = get_advantage_estimator("grpo")(rewards, mask, group_size=2)
    s = 0.5 / math.sqrt(0.5)
    close(adv, [[s, s], [-s, -s], [0.0, 0.0], [0.0, 0.0]], 1e-5)
    assert torch.equal(adv, ret)


def test_grpo_mean_only_and_group_of_one():
    rewards = T([[1.0], [0.0], [0.25], [0.75]])
    adv, _ = get_advantage_estimator("grpo")(rewards, torch.ones(4, 1), group_size=2, normalize_std=False)
    close(adv, [[0.5], [-0.5], [-0.25], [0.25]])
    adv1, _ = get_advantage_estimator("grpo")(rewards, torch.ones(4, 1), group_size=1)
    close(adv1, [[1.0], [0.0], [0.25], [0.75]], 1e-5)


def test_grpo_batch_must_split_into_groups():
    with pytest.raises(HflowError, match="groups of 4"):
        get_advantage_estimator("grpo")(torch.ones(6, 2), torch.ones(6, 2), group_size=4)


def test_rloo_leave_one_out():
    # scores 1, 0, .5: 1 − (0+.5)/2 = .75; 0 − (1+.5)/2 = −.75; .5 − (1+0)/2 = 0.
    rewards = T([[0.0, 1.0], [0.0, 0.0], [0.5, 0.0]])
    mask = T([[1, 1], [1, 1], [1, 0]])
    adv, _ = get_advantage_estimator("rloo")(rewards, mask, group_size=3)
    close(adv, [[0.75, 0.75], [-0.75, -0.75], [0.0, 0.0]])
    with pytest.raises(HflowError, match="samples_per_prompt >= 2"):
        get_advantage_estimator("rloo")(rewards, mask, group_size=1)


def test_remax_reward_to_go_minus_greedy_baseline():
    # to-go of [−.1, −.1, 1] is [.8, .9, 1]; minus baseline .5 → [.3, .4, .5]; padded row keeps zeros.
    rewards = T([[-0.1, -0.1, 1.0], [0.2, 0.0, 0.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    adv, ret = get_advantage_estimator("remax")(rewards, mask, baseline=T([0.5, 1.0]))
    close(adv, [[0.3, 0.4, 0.5], [-0.8, 0.0, 0.0]])
    close(ret, [[0.8, 0.9, 1.0], [0.2, 0.0, 0.0]])


def test_safe_rlhf_combination():
    # (1 − 1·.5)/(1 + 1) = .25; (−1 − 1·(−1))/2 = 0.
    close(safe_rlhf_advantages(T([[1.0, -1.0]]), T([[0.5, -1.0]]), 1.0, T([[1, 1]])), [[0.25, 0.0]])
