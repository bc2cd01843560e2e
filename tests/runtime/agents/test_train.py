"""The one-process update on conversation batches (runtime/agents/train.py) with a real tiny model: steps
of GRPO on a batch where one conversation of each group is rewarded raise the log-probs of its generated
tokens and lower the other's, and the gradient never depends on the masked (tool) tokens' targets."""

from __future__ import annotations

import torch
from engine_util import tiny_model

from hybridflow.runtime.agents.conversation import Conversation, conversation_batch
from hybridflow.runtime.agents.train import conversation_update, response_log_probs
from hybridflow.simulator.algorithms.settings import AdvantageSettings, PolicyLossSettings


def batch_for(model) -> dict[str, torch.Tensor]:
    convs = []
    for k in range(4):
        c = Conversation({}, [3, 4, 5 + k], [])
        c.add_model_turn([10 + k, 11, 12], [0.0] * 3, "call")
        c.add_context([40, 41, 42], [])
        c.add_model_turn([13 + k, 14], [0.0] * 2, "answer")
        convs.append(c)
    batch = conversation_batch(convs)
    with torch.no_grad():
        lp = response_log_probs(model, batch)
    batch["rollout_log_probs"] = lp * batch["response_mask"]
    return batch


def test_grpo_steps_move_rewarded_conversations_up():
    model = tiny_model(seed=0)
    batch = batch_for(model)
    gen = batch["response_mask"].bool()
    before = response_log_probs(model, batch).detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    for _ in range(3):
        conversation_update(model, opt, batch, scores, group_size=2, advantage=AdvantageSettings(estimator="grpo"),
                            loss=PolicyLossSettings(kind="reinforce"))
    after = response_log_probs(model, batch).detach()
    delta = ((after - before) * gen).sum(-1) / gen.sum(-1)
    assert delta[0] > 0 and delta[3] > 0 and delta[1] < 0 and delta[2] < 0, delta


def test_masked_tokens_do_not_reach_the_gradient():
    grads = []
    for tool_tokens in ([40, 41, 42], [7, 8, 9]):  # what the tool returned differs; the loss may not see it as a target
        model = tiny_model(seed=0)
        batch = batch_for(model)
        responses = batch["responses"].clone()
        responses[:, 3:6] = torch.tensor(tool_tokens)
        # the tokens stay in the context (attention) of later turns, so only compare the first turn's grads
        batch["responses"], batch["input_ids"] = responses, torch.cat([batch["prompt_ids"], responses], 1)
        batch["response_mask"][:, 3:] = 0  # train on the first turn only
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        conversation_update(model, opt, batch, torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2,
                            advantage=AdvantageSettings(estimator="grpo"), loss=PolicyLossSettings())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1])
