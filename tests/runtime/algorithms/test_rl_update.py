"""The actor update's fast paths keep the math: one-pass old log-probs, length buckets, dp balancing."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from engine_util import tiny_model
from tensordict import TensorDict

from hybridflow.runtime.algorithms.losses import actor_loss
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.logits import token_log_probs
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.rl.batches import dp_balanced_order
from hybridflow.runtime.workers.policy import PolicyObjective, PolicyWorker
from hybridflow.simulator.algorithms.settings import KLSettings, PolicyLossSettings

PROMPT, RESPONSE = 6, 5


def rl_batch(n: int = 8, seed: int = 0) -> TensorDict:
    """Left-padded prompts + right-padded responses of mixed lengths, as a rollout returns them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (n, PROMPT + RESPONSE), generator=g)
    p_len = torch.randint(2, PROMPT + 1, (n,), generator=g)
    r_len = torch.randint(1, RESPONSE + 1, (n,), generator=g)
    cols = torch.arange(PROMPT + RESPONSE)
    mask = (cols >= PROMPT - p_len[:, None]) & (cols < PROMPT + r_len[:, None])
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    response_mask = mask[:, PROMPT:].long()
    adv = torch.randn(n, 1, generator=g) * response_mask
    return TensorDict({"input_ids": ids, "attention_mask": mask.long(), "position_ids": pos,
                       "responses": ids[:, PROMPT:], "response_mask": response_mask, "advantages": adv},
                      batch_size=[n])


def actor_loss_fn(kl: KLSettings | None = None, **loss):
    """The actor worker's own loss function (PolicyWorker._loss_fn) with these loss settings."""
    objective = PolicyObjective(loss=PolicyLossSettings(**loss), kl=kl or KLSettings(), norm_length=RESPONSE)
    worker = SimpleNamespace(objective=objective)
    return lambda outputs, micro: PolicyWorker._loss_fn(worker, outputs, micro)


def grads(engine: FsdpEngine) -> list[torch.Tensor]:
    return [p.grad.clone() for p in engine.model.parameters()]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_one_pass_update_equals_two_pass_update(kl_coef):
    model, batch = tiny_model(), rl_batch()
    two = FsdpEngine(copy.deepcopy(model), optim=OptimConfig(lr=1e-2, grad_clip=0.0))
    one = FsdpEngine(copy.deepcopy(model), optim=OptimConfig(lr=1e-2, grad_clip=0.0))
    fields = ("input_ids", "attention_mask", "position_ids")
    if kl_coef:
        ref = FsdpEngine(tiny_model(seed=1)).compute_log_probs(batch.select(*fields))["log_probs"]
        batch["ref_log_probs"] = ref[:, -RESPONSE:]
    with_old = batch.clone()
    with_old["old_log_probs"] = two.compute_log_probs(batch.select(*fields))["log_probs"][:, -RESPONSE:]
    loss_fn = actor_loss_fn(kl=KLSettings(coef=kl_coef, placement="loss", estimator="k3"))
    m_two = two.train_step(with_old, loss_fn, 3, token_weights="response_mask")
    m_one = one.train_step(batch, loss_fn, 3, token_weights="response_mask", entropy=False)
    assert m_one["loss"] == pytest.approx(m_two["loss"], abs=1e-6)
    assert m_one["clipfrac"] == 0.0 and m_one["approx_kl"] == 0.0  # ratio exactly 1
    for a, b in zip(grads(one), grads(two), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(one.model.parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if kl_coef:
        assert m_one["kl"] == pytest.approx(m_two["kl"], abs=1e-6)


def plain_whole_batch_grads(model: torch.nn.Module, batch: TensorDict, aggregation: str = "token-mean"):
    """The reference: the whole batch in one masked forward (no buckets, no repacking), one loss."""
    model.zero_grad(set_to_none=True)
    out = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    lp = token_log_probs(out, batch["input_ids"])[:, -RESPONSE:]
    loss, _ = actor_loss(lp, lp.detach(), batch["advantages"], batch["response_mask"],
                         PolicyLossSettings(aggregation=aggregation), norm_length=RESPONSE)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("micro", [1, 3, 8])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_length_buckets_give_the_whole_batch_gradient(micro, aggregation):
    # Micro-batches weigh by their share of tokens for a token-mean, of rows for a mean over sequences.
    model, batch = tiny_model(), rl_batch(n=8, seed=2)
    expect = plain_whole_batch_grads(copy.deepcopy(model), batch, aggregation)
    engine = FsdpEngine(copy.deepcopy(model), optim=OptimConfig(lr=1e-2, grad_clip=0.0))
    weights = "response_mask" if aggregation == "token-mean" else None
    engine.train_step(batch, actor_loss_fn(aggregation=aggregation), micro, token_weights=weights, entropy=False)
    for a, b in zip(grads(engine), expect, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_log_probs_are_taken_at_the_sampling_temperature():
    model, batch = tiny_model(), rl_batch(n=4, seed=4)
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    expect = token_log_probs(logits / 0.5, batch["input_ids"])
    got = FsdpEngine(model, temperature=0.5).compute_log_probs(batch)["log_probs"]
    mask = batch["attention_mask"].bool() & torch.nn.functional.pad(batch["attention_mask"][:, :-1].bool(), (1, 0))
    torch.testing.assert_close(got[mask], expect[mask], rtol=1e-5, atol=1e-5)
    at_one = FsdpEngine(model).compute_log_probs(batch)["log_probs"]
    assert not torch.allclose(at_one[mask], got[mask])


def test_a_non_finite_gradient_skips_the_step_and_a_few_in_a_row_stop():
    from hybridflow.simulator.errors import HflowError

    engine = FsdpEngine(tiny_model(), optim=OptimConfig(lr=1e-2, max_skipped_steps=3))
    before = [p.detach().clone() for p in engine.model.parameters()]
    batch = rl_batch(n=4, seed=5)

    def poisoned(outputs, micro):  # a finite loss with a NaN gradient: min(e^(x+1000), 1) backs 0·inf up
        big = torch.exp(outputs["log_probs"] + 1000.0)
        return torch.minimum(big, torch.ones_like(big)).sum()

    def nan_grad(outputs, micro):
        return (outputs["log_probs"] * torch.tensor(float("nan"))).sum()

    for i in range(2):
        m = engine.train_step(batch, nan_grad, 2)
        assert m["skipped"] == 1.0 and m["step"] == 0, i
    for a, b in zip(before, engine.model.parameters(), strict=True):
        assert torch.equal(a, b)  # no NaN written into the weights
    good = engine.train_step(batch, lambda o, mi: -o["log_probs"].sum() / 100, 2)
    assert good["skipped"] == 0.0 and good["step"] == 1  # and the streak starts again
    m = engine.train_step(batch, poisoned, 2)
    assert math.isfinite(m["loss"]) and not math.isfinite(m["grad_norm"]) and m["skipped"] == 1.0
    engine.train_step(batch, nan_grad, 2)
    with pytest.raises(HflowError, match="3 optimizer steps in a row had a non-finite gradient"):
        engine.train_step(batch, nan_grad, 2)
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())


def test_repacked_log_probs_match_the_masked_forward():
    model, batch = tiny_model(), rl_batch(n=8, seed=3)
    with torch.no_grad():
        full = token_log_probs(model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]),
                               batch["input_ids"])
    got = FsdpEngine(model).compute_log_probs(batch, micro_batch_size=3)["log_probs"]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[:, -RESPONSE:][mask], full[:, -RESPONSE:][mask], rtol=1e-5, atol=1e-5)
    assert (got[batch["attention_mask"] == 0] == 0).all()  # padding comes back as 0


def test_dp_balanced_order_gives_each_rank_the_same_mix_of_lengths():
    lengths = torch.tensor([3, 9, 1, 5, 7, 2, 8, 4])
    mask = (torch.arange(10)[None] < lengths[:, None]).long()
    order = dp_balanced_order(mask, 2)
    assert sorted(order.tolist()) == list(range(8))
    halves = lengths[order].view(2, -1)
    assert abs(int(halves[0].sum()) - int(halves[1].sum())) <= 1
    assert dp_balanced_order(mask, 1) is None and dp_balanced_order(mask, 3) is None
