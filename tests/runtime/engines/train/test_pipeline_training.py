"""Pipeline-parallel training (torch.distributed.pipelining on gloo) follows the single-process curve."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import nll_loss, tiny_model, token_batch
from tensordict import TensorDict

from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.fsdp.pipeline import equal_micro_size, split_stage, stage_layers
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

STEPS = 3
OPTIM = OptimConfig(lr=3e-3, grad_clip=0.5)
LAYERS = 4  # two layers per stage at pp=2


def _batch(dp_rank: int = 0, dp: int = 1) -> TensorDict:
    full = token_batch(n=8)
    full["attention_mask"][:2, :3] = 0  # left padding on two rows: masks and positions must travel
    per = 8 // dp
    return TensorDict({k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in full.items()}, batch_size=[per])


def _run(engine: FsdpEngine, batch: TensorDict, score: bool):
    if score:
        def loss_fn(out, micro):
            return ((out["values"] - 1.0) * micro["attention_mask"]).pow(2).mean()
        before = engine.compute_values(batch, micro_batch_size=2)["values"]
    else:
        loss_fn = nll_loss
        before = engine.compute_log_probs(batch, micro_batch_size=2, entropy=True)
        before = torch.stack([before["log_probs"], before["entropy"]])
    metrics = [engine.train_step(batch, loss_fn) for _ in range(STEPS)]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], engine.full_state_dict(), before


def _train(rank, world, pp, tp, dp, score):
    engine = FsdpEngine(tiny_model(score=score, num_hidden_layers=LAYERS), ParallelConfig(pp=pp, tp=tp, dp=dp),
                            optim=OPTIM, micro_batch_size=2)
    return (*_run(engine, _batch(engine.dp_rank, dp), score), engine.dp_rank)


def _reference(score: bool):
    engine = FsdpEngine(tiny_model(score=score, num_hidden_layers=LAYERS), optim=OPTIM, micro_batch_size=2)  # same micro split: per-micro means
    return _run(engine, _batch(), score)


@pytest.mark.parametrize("pp,tp,dp,score", [(2, 1, 1, False), (2, 1, 2, True), (2, 2, 1, False)])
def test_pipeline_training_matches_single_process(pp, tp, dp, score):
    """pp=2 (GPipe, 2 micro-batches per rank); pp×dp: FSDP2 inside stages (critic); pp×tp: DTensor TP."""
    ref_loss, ref_norm, ref_state, ref_before = _reference(score)
    assert ref_loss[-1] < ref_loss[0]
    per = 8 // dp
    for loss, norm, state, before, k in run_distributed(_train, pp * tp * dp, pp, tp, dp, score):
        # forward-only results on every rank: this dp rank's rows of the reference
        torch.testing.assert_close(before, ref_before[..., k * per:(k + 1) * per, :], rtol=0, atol=1e-5)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-4, msg=name)


def test_stage_split_keeps_hf_names_and_covers_the_model():
    assert [list(stage_layers(5, s, 2)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert equal_micro_size(6, 4) == 3 and equal_micro_size(7, 2) == 1 and equal_micro_size(8, 16) == 8
    whole = tiny_model(num_hidden_layers=LAYERS).state_dict()
    stages = [split_stage(tiny_model(num_hidden_layers=LAYERS), s, 2).state_dict() for s in range(2)]
    assert set(stages[0]) | set(stages[1]) == set(whole) and not set(stages[0]) & set(stages[1])
    assert "model.embed_tokens.weight" in stages[0] and "lm_head.weight" in stages[1]
    assert "model.layers.2.mlp.up_proj.weight" in stages[1]
    with pytest.raises(HflowError, match="untied"):
        split_stage(tiny_model(tie_word_embeddings=True), 0, 2)
    with pytest.raises(HflowError, match="exceeds"):
        split_stage(tiny_model(), 0, 3)


def _save_load(rank, world, path):
    batch = _batch(rank % 2, 2)
    cfg = ParallelConfig(pp=2, dp=2)
    engine = FsdpEngine(tiny_model(num_hidden_layers=LAYERS), cfg, optim=OptimConfig(lr=1e-2), micro_batch_size=2)
    engine.train_step(batch, nll_loss)
    engine.save(path)
    expect = engine.train_step(batch, nll_loss)["loss"]
    fresh = FsdpEngine(tiny_model(seed=3, num_hidden_layers=LAYERS), cfg, optim=OptimConfig(lr=1e-2),
                           micro_batch_size=2)
    fresh.load(path)
    return expect, fresh.train_step(batch, nll_loss)["loss"]


def test_pipeline_save_load(tmp_path):
    for expect, got in run_distributed(_save_load, 4, str(tmp_path / "ckpt")):
        assert got == expect
