"""Sharded training (FSDP2 + DTensor TP on gloo) follows the single-process loss curve."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import engine_errors, nll_loss, tiny_model, token_batch
from tensordict import TensorDict

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.engines.train.fsdp.engine import (
    FsdpEngine,
    OptimConfig,
    token_entropy,
    token_log_probs,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

STEPS = 3
OPTIM = OptimConfig(lr=3e-3, grad_clip=0.5)


def _local_batch(dp_rank: int, dp: int) -> TensorDict:
    full = token_batch(n=8)
    per = 8 // dp
    return TensorDict({k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}, batch_size=[per])


def _train(rank, world, tp, dp, save_dir=None):
    engine = FsdpEngine(tiny_model(), ParallelConfig(tp=tp, dp=dp), optim=OPTIM, micro_batch_size=2)
    batch = _local_batch(engine.dp_rank, dp)
    metrics = [engine.train_step(batch, nll_loss) for _ in range(STEPS)]
    state = engine.full_state_dict()
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], state


def _reference():
    engine = FsdpEngine(tiny_model(), optim=OPTIM, micro_batch_size=4)
    batch = _local_batch(0, 1)
    metrics = [engine.train_step(batch, nll_loss) for _ in range(STEPS)]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], engine.full_state_dict()


@pytest.mark.parametrize("tp,dp", [(2, 2), (4, 1)])
def test_sharded_training_matches_single_process(tp, dp):
    """FSDP2 + TP (2-D mesh) and pure TP (DTensor and plain parameters mixed) on 4 processes."""
    ref_loss, ref_norm, ref_state = _reference()
    assert ref_loss[-1] < ref_loss[0]  # it learns
    results = run_distributed(_train, 4, tp, dp)
    for loss, norm, state in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-4, msg=name)  # Adam: lr-sized steps, 3e-3


def test_token_log_probs_and_entropy_match_definitions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lp, ent = token_log_probs(logits, ids), token_entropy(logits)
    assert lp.shape == ent.shape == (2, 5) and (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    dist = torch.distributions.Categorical(logits=logits[:, :-1])
    torch.testing.assert_close(lp[:, 1:], dist.log_prob(ids[:, 1:]))
    torch.testing.assert_close(ent[:, 1:], dist.entropy())


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    batch = TensorDict(token_batch(n=6), batch_size=[6])
    losses = []
    for micro in (6, 2):
        engine = FsdpEngine(tiny_model(), optim=OptimConfig(lr=1e-2, grad_clip=0.0), micro_batch_size=micro)
        losses.append([engine.train_step(batch, nll_loss)["loss"] for _ in range(2)])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_gradient_clipping_bounds_the_update():
    batch = TensorDict(token_batch(n=4), batch_size=[4])
    engine = FsdpEngine(tiny_model(), optim=OptimConfig(lr=1.0, grad_clip=1e-3, betas=(0.0, 0.0)))
    engine.train_step(batch, nll_loss)
    grads = [p.grad for p in engine.model.parameters()]
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    assert total.item() == pytest.approx(1e-3, rel=1e-3)


def test_values_from_scalar_head_and_errors():
    engine = FsdpEngine(tiny_model(score=True))
    out = engine.compute_values(token_batch(n=3), micro_batch_size=2)
    assert out["values"].shape == (3, 12) and out["values"].dtype == torch.float32
    with pytest.raises(HflowError, match="process group|torch.distributed"):
        FsdpEngine(tiny_model(), ParallelConfig(tp=2))


def _bad_configs(rank, world):
    return engine_errors(((ParallelConfig(pp=2), dict(tie_word_embeddings=True)), (ParallelConfig(tp=3), {}),
                          (ParallelConfig(tp=2), dict(num_key_value_heads=1))))


def test_unsupported_layouts_are_one_line_errors():
    messages = run_distributed(_bad_configs, 2)[0]
    assert len(messages) == 3
    assert "untied" in messages[0] and "3 processes" in messages[1] and "tp=2 must divide" in messages[2]


@pytest.mark.parametrize("store", ["path", "url"])
def test_save_load_restores_weights_optimizer_and_rng(tmp_path, store):
    # "url": fsspec's memory:// (DCP's fsspec writer and reader); none of its files is on disk
    root = str(tmp_path) if store == "path" else f"memory://engine-{tmp_path.name}"
    batch = TensorDict(token_batch(n=4), batch_size=[4])
    engine = FsdpEngine(tiny_model(), optim=OptimConfig(lr=1e-2))
    engine.train_step(batch, nll_loss)
    engine.save(f"{root}/ckpt")
    expect = [engine.train_step(batch, nll_loss)["loss"] for _ in range(2)]
    expect_rand = torch.rand(3)

    fresh = FsdpEngine(tiny_model(seed=5), optim=OptimConfig(lr=1e-2))
    fresh.load(f"{root}/ckpt")
    assert fresh.step == 1
    got = [fresh.train_step(batch, nll_loss)["loss"] for _ in range(2)]
    assert got == expect  # weights and Adam moments restored exactly
    assert torch.equal(torch.rand(3), expect_rand)
    with pytest.raises(HflowError, match="not a training checkpoint"):
        fresh.load(f"{root}/nowhere")
    if store == "url":
        assert not list(tmp_path.iterdir())
        Location(root).remove()


def _save_load_sharded(rank, world, path):
    batch = _local_batch(rank // 2, 2)
    engine = FsdpEngine(tiny_model(), ParallelConfig(tp=2, dp=2), optim=OptimConfig(lr=1e-2))
    engine.train_step(batch, nll_loss)
    engine.save(path)
    expect = engine.train_step(batch, nll_loss)["loss"]
    fresh = FsdpEngine(tiny_model(seed=3), ParallelConfig(tp=2, dp=2), optim=OptimConfig(lr=1e-2))
    fresh.load(path)
    return expect, fresh.train_step(batch, nll_loss)["loss"]


def test_sharded_save_load(tmp_path):
    for expect, got in run_distributed(_save_load_sharded, 4, str(tmp_path / "ckpt")):
        assert got == expect


def _gather_between_steps(rank, world, tp, dp):
    from hybridflow.runtime.engines.parallelize import tp_local

    engine = FsdpEngine(tiny_model(), ParallelConfig(tp=tp, dp=dp), optim=OPTIM, micro_batch_size=2)
    batch = _local_batch(engine.dp_rank, dp)
    losses, same, resharded = [], [], []
    for _ in range(STEPS):
        per_param = {n: tp_local(p.detach()) for n, p in engine.model.named_parameters()}  # a collective each
        local = {n: p.to_local().numel() for n, p in engine.model.named_parameters()}
        with engine.gathered_tp_shards() as shards:
            same.append(shards.keys() == per_param.keys() and all(torch.equal(shards[n], v) for n, v in per_param.items()))
        resharded.append(all(p.to_local().numel() == local[n] for n, p in engine.model.named_parameters()))
        losses.append(engine.train_step(batch, nll_loss)["loss"])
    return losses, same, resharded, len(engine._fsdp_units)


def test_batched_dp_gather_equals_per_parameter_and_training_goes_on():
    """gathered_tp_shards (one all-gather per FSDP unit) gives each rank exactly the per-parameter
    gather's tensors, leaves the weights sharded again, and the steps after it are unchanged."""
    ref_loss = _reference()[0]
    for losses, same, resharded, units in run_distributed(_gather_between_steps, 4, 2, 2):
        assert units == tiny_model().config.num_hidden_layers + 1  # each decoder layer and the root
        assert all(same) and all(resharded)
        assert losses == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
