"""Training on conversations (runtime/agents/conversation.py `conversation_batch`, train.py): a hand-built
two-conversation batch has its masks at the exact token positions; the GRPO advantages, the PPO loss and
the KL mean equal a hand computation over generated tokens only; and for every advantage estimator,
policy loss and aggregation, what sits at a masked position (tool results, observations, scaffolding)
changes neither the loss nor its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.runtime.agents.conversation import Conversation, conversation_batch
from hybridflow.runtime.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from hybridflow.runtime.algorithms.losses import POLICY_LOSSES, actor_loss, scores_to_token_rewards
from hybridflow.simulator.algorithms.settings import AdvantageSettings, KLSettings, PolicyLossSettings

PAD = 0


def hand_conversations() -> list[Conversation]:
    """Row 0: prompt [5 6 7]; model turn [10 11 12]; tool turn [20 21]; model turn [13 14].
    Row 1: prompt [5 6]; one model turn [15]."""
    a = Conversation({}, [5, 6, 7], [])
    a.add_model_turn([10, 11, 12], [-0.1, -0.2, -0.3], "call")
    a.add_context([20, 21], [{"role": "tool", "content": "4"}])
    a.add_model_turn([13, 14], [-0.4, -0.5], "4")
    a.turn_rewards = [0.25, 1.0]
    b = Conversation({}, [5, 6], [])
    b.add_model_turn([15], [-0.6], "7")
    return [a, b]


def test_masks_at_exact_positions():
    batch = conversation_batch(hand_conversations(), PAD)
    assert batch["prompt_ids"].tolist() == [[5, 6, 7], [PAD, 5, 6]]
    assert batch["prompt_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert batch["responses"].tolist() == [[10, 11, 12, 20, 21, 13, 14], [15, PAD, PAD, PAD, PAD, PAD, PAD]]
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 10, [0, 1, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 10, 11, 12, 20, 21, 13, 14], [PAD, 5, 6, 15] + [PAD] * 6]
    assert batch["position_ids"].tolist() == [list(range(10)), [0, 0, 1, 2, 2, 2, 2, 2, 2, 2]]
    assert torch.allclose(batch["rollout_log_probs"], torch.tensor(
        [[-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5], [-0.6, 0, 0, 0, 0, 0, 0]]))
    assert batch["token_rewards"].tolist() == [[0, 0, 0.25, 0, 0, 0, 1.0], [0] * 7]  # each turn's last token


def test_grpo_ppo_and_kl_equal_a_hand_computation():
    batch = conversation_batch(hand_conversations(), PAD)
    mask = batch["response_mask"]
    scores = torch.tensor([1.0, 0.0])
    adv, _ = get_advantage_estimator("grpo")(scores_to_token_rewards(scores, mask), mask,
                                             AdvantageSettings(estimator="grpo"), group_size=2)
    a = 0.5 / math.sqrt(0.5)  # (1 − 0.5) / std([1, 0]) (unbiased std), the ε aside
    assert adv.tolist()[0] == pytest.approx([a, a, a, 0, 0, a, a], rel=1e-5)
    assert adv.tolist()[1] == pytest.approx([-a, 0, 0, 0, 0, 0, 0], rel=1e-5)

    old = batch["rollout_log_probs"]
    new = old + torch.tensor([[0.5, -0.5, 0.0, 9.0, -9.0, 0.1, 0.3], [0.2, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0]])
    ref = old - 0.05
    loss, stats = actor_loss(new, old, adv, mask, PolicyLossSettings(), ref_logprobs=ref)
    hand = []
    for i, row in enumerate(mask.tolist()):
        for t, m in enumerate(row):
            if m:
                r, A = math.exp(float(new[i, t] - old[i, t])), float(adv[i, t])
                hand.append(-min(r * A, min(max(r, 0.8), 1.2) * A))
    assert float(loss) == pytest.approx(sum(hand) / 6, rel=1e-5)  # 6 generated tokens, not 10 real ones
    kl = [float(new[i, t] - ref[i, t]) for i, row in enumerate(mask.tolist()) for t, m in enumerate(row) if m]
    assert stats["kl"] == pytest.approx(sum(kl) / 6, rel=1e-5)


def _loss_and_grad(estimator: str, kind: str, aggregation: str, fill: float):
    torch.manual_seed(0)
    batch = conversation_batch(hand_conversations() * 2, PAD)  # 4 rows: 2 groups of 2
    mask = batch["response_mask"]
    off = mask == 0
    noise = torch.randn(mask.shape)
    logits = torch.randn(mask.shape, requires_grad=True)
    # masked positions get values that differ between the two calls: they must not matter
    new = torch.where(off, torch.full(mask.shape, fill), logits.log_softmax(-1))
    old = torch.where(off, torch.full(mask.shape, -fill), batch["rollout_log_probs"] + 0.1 * noise)
    ref = torch.where(off, torch.full(mask.shape, 2 * fill), old - 0.05)
    values = torch.where(off, torch.full(mask.shape, 3 * fill), 0.1 * noise)
    token_rewards = scores_to_token_rewards(torch.tensor([1.0, 0.0, 0.0, 1.0]), mask)
    token_rewards = torch.where(off, torch.full(mask.shape, 0.0), token_rewards)
    settings = AdvantageSettings(estimator=estimator)
    adv, _ = get_advantage_estimator(estimator)(token_rewards, mask, settings, group_size=2, values=values,
                                                baseline=torch.tensor([0.5, 0.5, 0.5, 0.5]))
    loss, _ = actor_loss(new, old, adv, mask, PolicyLossSettings(kind=kind, aggregation=aggregation),
                         norm_length=8, ref_logprobs=ref, kl=KLSettings(coef=0.1, placement="loss", estimator="k3"))
    loss.backward()
    return float(loss), logits.grad.clone(), adv


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_masked_positions_change_nothing_for_every_algorithm(estimator, kind):
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        l1, g1, a1 = _loss_and_grad(estimator, kind, aggregation, 3.0)
        l2, g2, a2 = _loss_and_grad(estimator, kind, aggregation, -5.0)
        mask = conversation_batch(hand_conversations() * 2, PAD)["response_mask"].bool()
        assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-7), (estimator, kind, aggregation)
        assert torch.allclose(g1, g2, atol=1e-7), (estimator, kind, aggregation)
        assert torch.equal(a1[mask], a2[mask]) and not a1[~mask].any()
