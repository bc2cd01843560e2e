"""Advantage estimators against values computed by hand from their papers' formulas (the arithmetic is in
the comments), with the edge cases: a group whose rewards are all equal, an all-masked row, a response
of one token, a NaN or infinite reward."""

import math

import pytest
import torch

from hybridflow.runtime.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from hybridflow.runtime.algorithms.functional import masked_mean, masked_sum, masked_whiten
from hybridflow.runtime.algorithms.losses import POLICY_LOSSES
from hybridflow.simulator.algorithms import algorithm_names, get_algorithm
from hybridflow.simulator.algorithms.settings import AdvantageSettings, LagrangeSettings
from hybridflow.simulator.errors import HflowError

T = torch.tensor
RAW = AdvantageSettings(whiten=False)


def close(a, b, tol=1e-6):
    assert torch.allclose(a.float(), T(b).float(), atol=tol), f"{a} != {b}"


def est(name, rewards, mask, settings=RAW, **kw):
    return get_advantage_estimator(name)(torch.as_tensor(rewards), torch.as_tensor(mask), settings, **kw)


def test_every_algorithm_names_a_registered_estimator_and_loss():
    for name in algorithm_names():
        d = get_algorithm(name).defaults
        assert d.advantage.estimator in ADVANTAGE_ESTIMATORS and d.loss.kind in POLICY_LOSSES, name
    with pytest.raises(HflowError, match="unknown advantage estimator 'vtrace'; known: gae"):
        get_advantage_estimator("vtrace")


# ---- GAE ---------------------------------------------------------------------------------------
def test_gae_gamma_one_lambda_one():
    # δ2 = 1 − .7 = .3; δ1 = 0 + .7 − .6 = .1; δ0 = .6 − .5 = .1 → A = [.5, .4, .3]; R = A + V = 1.
    adv, ret = est("gae", [[0.0, 0.0, 1.0]], [[1, 1, 1]], AdvantageSettings(gamma=1.0, lam=1.0, whiten=False),
                   values=T([[0.5, 0.6, 0.7]]))
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted():
    # γ=.9, λ=.5: δ2=.3, A2=.3; δ1=.9·.7−.6=.03, A1=.03+.45·.3=.165; δ0=.9·.6−.5=.04, A0=.04+.45·.165=.11425.
    adv, ret = est("gae", [[0.0, 0.0, 1.0]], [[1, 1, 1]], AdvantageSettings(gamma=0.9, lam=0.5, whiten=False),
                   values=T([[0.5, 0.6, 0.7]]))
    close(adv, [[0.11425, 0.165, 0.3]])
    close(ret, [[0.61425, 0.765, 1.0]])


def test_gae_skips_padding_and_an_all_masked_row():
    # Row 0 has a padded last token (value 9 must not leak): δ1 = 1 − .4 = .6; δ0 = .4 − .2 = .2 → [.8, .6, 0].
    # Row 1 is all padding: zeros, whatever its rewards and values hold (NaN included).
    adv, ret = est("gae", [[0.0, 1.0, 0.0], [float("nan"), 5.0, 1.0]], [[1, 1, 0], [0, 0, 0]],
                   AdvantageSettings(gamma=1.0, lam=1.0, whiten=False), values=T([[0.2, 0.4, 9.0], [1.0, 1.0, 1.0]]))
    close(adv, [[0.8, 0.6, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_gae_whitened_has_zero_mean_unit_variance_on_response_tokens():
    m = T([[1, 1, 0], [1, 1, 1]])
    adv, _ = est("gae", [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]], m, AdvantageSettings(),
                 values=T([[0.2, 0.4, 9.0], [0.1, 0.1, 0.1]]))
    assert adv[0, 2] == 0
    assert abs(masked_mean(adv, m).item()) < 1e-6
    assert abs(masked_mean(adv**2, m).item() * 5 / 4 - 1) < 1e-5  # unbiased variance 1


def test_gae_without_values_says_what_to_do():
    with pytest.raises(HflowError, match="critic"):
        est("gae", [[1.0]], [[1]])


# ---- GRPO and Dr.GRPO -----------------------------------------------------------------------------
def test_grpo_group_normalised_and_all_equal_group_is_zero():
    # groups (1, 0) and (.5, .5): mean .5, unbiased std √.5 → ±.5/.70711 = ±.70711; second group std 0 → 0.
    adv, ret = est("grpo", [[0.0, 1.0], [0.0, 0.0], [0.5, 0.0], [0.0, 0.5]], [[1, 1], [1, 1], [1, 0], [1, 1]],
                   group_size=2)
    s = 0.5 / math.sqrt(0.5)
    close(adv, [[s, s], [-s, -s], [0.0, 0.0], [0.0, 0.0]], 1e-5)
    assert torch.equal(adv, ret)


def test_dr_grpo_mean_only_and_group_of_one():
    rewards, mask = [[1.0], [0.0], [0.25], [0.75]], torch.ones(4, 1)
    adv, _ = est("grpo", rewards, mask, AdvantageSettings(normalize_std=False), group_size=2)
    close(adv, [[0.5], [-0.5], [-0.25], [0.25]])
    adv1, _ = est("grpo", rewards, mask, group_size=1)  # a group of one: mean 0, std 1
    close(adv1, [[1.0], [0.0], [0.25], [0.75]], 1e-5)


def test_grpo_length_one_response_and_all_masked_row():
    # scores 2 (one token) and 0 (no tokens): mean 1, std √2 → ±.70711 on the one token, 0 on the empty row.
    adv, _ = est("grpo", [[2.0, 0.0], [7.0, 7.0]], [[1, 0], [0, 0]], group_size=2)
    close(adv, [[1 / math.sqrt(2), 0.0], [0.0, 0.0]], 1e-5)


def test_grpo_batch_must_split_into_groups():
    with pytest.raises(HflowError, match="groups of 4"):
        est("grpo", torch.ones(6, 2).tolist(), torch.ones(6, 2), group_size=4)


# ---- RLOO, ReMax, REINFORCE++ ---------------------------------------------------------------------
def test_rloo_leave_one_out():
    # scores 1, 0, .5: 1 − (0+.5)/2 = .75; 0 − (1+.5)/2 = −.75; .5 − (1+0)/2 = 0.
    rewards, mask = [[0.0, 1.0], [0.0, 0.0], [0.5, 0.0]], [[1, 1], [1, 1], [1, 0]]
    adv, _ = est("rloo", rewards, mask, group_size=3)
    close(adv, [[0.75, 0.75], [-0.75, -0.75], [0.0, 0.0]])
    with pytest.raises(HflowError, match="samples_per_prompt >= 2"):
        est("rloo", rewards, mask, group_size=1)
    equal, _ = est("rloo", [[0.3], [0.3]], [[1], [1]], group_size=2)  # all-equal group
    close(equal, [[0.0], [0.0]])


def test_remax_reward_to_go_minus_greedy_baseline():
    # to-go of [−.1, −.1, 1] is [.8, .9, 1]; minus baseline .5 → [.3, .4, .5]; the one-token row: .2 − 1.
    adv, ret = est("remax", [[-0.1, -0.1, 1.0], [0.2, 0.0, 0.0]], [[1, 1, 1], [1, 0, 0]], baseline=T([0.5, 1.0]))
    close(adv, [[0.3, 0.4, 0.5], [-0.8, 0.0, 0.0]])
    close(ret, [[0.8, 0.9, 1.0], [0.2, 0.0, 0.0]])


def test_reinforce_pp_discounted_returns_whitened_over_the_batch():
    # γ = 1: G = [1, 1, 1] and [.5, .5, –]; over 5 tokens mean .8, unbiased var (3·.04 + 2·.09)/4 = .075.
    adv, ret = est("reinforce++", [[0.0, 0.0, 1.0], [0.0, 0.5, 9.0]], [[1, 1, 1], [1, 1, 0]], AdvantageSettings())
    close(ret, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]])
    hi, lo = 0.2 / math.sqrt(0.075), -0.3 / math.sqrt(0.075)
    close(adv, [[hi, hi, hi], [lo, lo, 0.0]], 1e-4)
    # γ = .5, no whitening: G = [.25, .5, 1].
    raw, _ = est("reinforce++", [[0.0, 0.0, 1.0]], [[1, 1, 1]], AdvantageSettings(gamma=0.5, whiten=False))
    close(raw, [[0.25, 0.5, 1.0]])


def test_reinforce_pp_baseline_group_mean_then_batch_std():
    # groups (1, 0), (.5, .5): centred .5, −.5, 0, 0; unbiased std over 4 = √(.5/3) → ±1.22474, 0, 0.
    adv, _ = est("reinforce++-baseline", [[1.0], [0.0], [0.5], [0.5]], torch.ones(4, 1), AdvantageSettings(),
                 group_size=2)
    s = 0.5 / math.sqrt(0.5 / 3)
    close(adv, [[s], [-s], [0.0], [0.0]], 1e-5)


# ---- bad rewards ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "remax", "reinforce++", "reinforce++-baseline"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_reward_is_a_clear_error(name, bad):
    kw = {"values": torch.zeros(2, 2), "baseline": torch.zeros(2), "group_size": 2}
    with pytest.raises(HflowError, match=r"sample\(s\) \[1\] is NaN or infinite"):
        est(name, [[0.0, 1.0], [0.0, bad]], [[1, 1], [1, 1]], AdvantageSettings(), **kw)


def test_masking_selects_so_nan_on_padding_does_not_leak():
    x, m = T([[1.0, float("nan")], [3.0, float("inf")]]), T([[1, 0], [1, 0]])
    assert masked_sum(x, m).item() == 4.0 and masked_mean(x, m).item() == 2.0
    close(masked_whiten(x, m), [[-1 / math.sqrt(2), 0.0], [1 / math.sqrt(2), 0.0]], 1e-5)


def test_masked_whiten_by_hand():
    # mean 2, unbiased var (1 + 0 + 1)/2 = 1 → [−1, 0, 1, 0].
    close(masked_whiten(T([[1.0, 2.0, 3.0, 50.0]]), T([[1, 1, 1, 0]])), [[-1.0, 0.0, 1.0, 0.0]], 1e-5)


# ---- the algorithms' hooks on tensors ---------------------------------------------------------------
def test_safe_rlhf_combines_reward_and_cost_advantages_with_lambda():
    hooks = get_algorithm("safe-rlhf").hooks
    lam = hooks.driver_state(get_algorithm("safe-rlhf").defaults.model_copy(
        update={"lagrange": LagrangeSettings(init=1.0, lr=0.1, window=4)}))
    # (A_r − λ·A_c)/(1 + λ) at λ = 1: (1 − .5)/2 = .25; (−1 + 1)/2 = 0.
    close(hooks.combine({"reward": T([[1.0, -1.0]]), "cost": T([[0.5, -1.0]])}, lam), [[0.25, 0.0]])
    # λ steps before the advantages, from the window: log λ = 0 + .1·(mean(2, 0) − 0)·1 → λ = e^.1.
    stats = hooks.on_scores(lam, {"reward": T([0.0, 0.0]), "cost": T([2.0, 0.0])})
    assert stats["lagrange"] == pytest.approx(math.exp(0.1)) and lam.value == pytest.approx(math.exp(0.1))


def test_dapo_keeps_only_groups_whose_rewards_differ():
    keep = get_algorithm("dapo").hooks.keep_groups(T([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.25]]))
    assert keep.tolist() == [False, True, False, True]
    assert get_algorithm("grpo").hooks.keep_groups(T([[1.0, 1.0]])) is None  # others keep everything


def test_dapo_overlong_penalty_by_hand():
    from hybridflow.runtime.algorithms.advantages import overlong_penalty

    # L_max = 10, L_cache = .2·10 = 2: 0 up to 8 tokens, then (8 − |y|)/2: 9 → −.5, 10 → −1 (×1.5 penalty).
    got = overlong_penalty(T([1, 8, 9, 10]), budget=10, buffer=0.2, penalty=1.5)
    close(got, [0.0, 0.0, -0.75, -1.5])


def test_rollouts_of_different_prompt_widths_concatenate():
    from hybridflow.runtime.controller.batch import Batch
    from hybridflow.runtime.rl.batches import left_pad_prompts

    b = Batch({"prompt_ids": T([[5, 6]]), "prompt_mask": T([[1, 1]]), "input_ids": T([[5, 6, 7]]),
               "attention_mask": T([[1, 1, 1]]), "position_ids": T([[0, 1, 2]]), "responses": T([[7]])},
              non_tensors={"prompt": ["x"]})
    wide = left_pad_prompts(b, 4)
    assert wide["input_ids"].tolist() == [[0, 0, 5, 6, 7]] and wide["attention_mask"].tolist() == [[0, 0, 1, 1, 1]]
    assert wide["responses"].tolist() == [[7]] and list(wide["prompt"]) == ["x"]
    assert left_pad_prompts(b, 2) is b
