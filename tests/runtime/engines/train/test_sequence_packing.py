"""Sequence packing (engines/train/fsdp/packed.py): micro-batches by a token budget, each one row of sequences
with attention confined to each. On mixed lengths it scores the same log-probs, entropy and values as the
padded pass and takes the same training step — losses and gradients — for every loss aggregation mode, on
data-parallel gloo processes and under Ulysses sequence parallelism."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import tiny_model
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from hybridflow.runtime.algorithms.losses import aggregate
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import get_protocol
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
from hybridflow.runtime.engines.train.packing import pack_sequences, token_budget_bins
from hybridflow.runtime.models.decoder import positions_from_mask
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

P, R = 6, 26  # prompt and response columns
N = 16
BUDGET = 48  # tokens per packed micro-batch; the longest sequence has 32
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
OPTIM = OptimConfig(lr=3e-3, grad_clip=1.0)


def _batch(seed: int = 0) -> TensorDict:
    """Left-padded prompts of 2-6 tokens and right-padded responses of long-tailed lengths (most short, a few
    the whole width), with advantages: an RL batch."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (N,), generator=g)
    response_len = torch.tensor([1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 6, 7, 9, 12, 20, R])[torch.randperm(N, generator=g)]
    cols = torch.arange(P + R)
    mask = ((cols >= P - prompt_len[:, None]) & (cols < P + response_len[:, None])).long()
    ids = torch.randint(1, 128, (N, P + R), generator=g) * mask
    return TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": positions_from_mask(mask),
                       "response_mask": mask[:, P:].clone(), "advantages": torch.randn(N, R, generator=g)},
                      batch_size=[N])


def _policy_loss(mode: str):
    def loss_fn(outputs, micro):
        per_token = -outputs["log_probs"][:, -R:] * micro["advantages"] - 0.01 * outputs["entropy"][:, -R:]
        return aggregate(per_token, micro["response_mask"], mode, norm_length=R)
    return loss_fn


def _grads(engine) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in engine.model.named_parameters()}


def _passes(engine: FsdpEngine, batch: TensorDict) -> dict:
    """Log-probs and entropy (all columns, and the responses only), then two steps of every aggregation mode."""
    out = {"scored": engine.compute_log_probs(batch, entropy=True),
           "responses": engine.compute_log_probs(batch, entropy=True, score_width=R)}
    for mode in MODES:
        weights = "response_mask" if mode == "token-mean" else None
        for step in range(2):
            loss = engine.train_step(batch, _policy_loss(mode), token_weights=weights, score_width=R)["loss"]
            out[f"{mode}/{step}"] = (loss, _grads(engine))
    return out


def _values(engine: FsdpEngine, batch: TensorDict) -> torch.Tensor:
    return engine.compute_values(batch)["values"]


def _both(parallel: ParallelConfig | None, batch: TensorDict) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    padded = FsdpEngine(tiny_model(), parallel, optim=OPTIM, micro_batch_size=3)
    packed = FsdpEngine(tiny_model(), parallel, optim=OPTIM, micro_batch_tokens=BUDGET)
    values = [_values(FsdpEngine(tiny_model(score=True), parallel, **kw), batch)
              for kw in ({"micro_batch_size": 3}, {"micro_batch_tokens": BUDGET})]
    return _passes(padded, batch), _passes(packed, batch), *values


def _rank(rank, world, sp):
    parallel = ParallelConfig(dp=world, sp=sp)
    parts, _ = get_protocol("DP_COMPUTE").split(Batch(_batch()), parallel)
    return _both(parallel, parts[rank].tensors)


def _check(padded: dict, packed: dict, values_padded, values_packed, batch: TensorDict) -> None:
    real = batch["attention_mask"].bool().clone()
    real[:, 0] = False  # column 0 has no prediction
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(packed["scored"][key][real], padded["scored"][key][real], rtol=0, atol=1e-6)
        read = batch["response_mask"].bool()  # what a caller of score_width=R reads
        torch.testing.assert_close(packed["responses"][key][:, -R:][read], padded["responses"][key][:, -R:][read],
                                   rtol=0, atol=1e-6)
        assert (packed["scored"][key][~batch["attention_mask"].bool()] == 0).all()  # padding: 0
    torch.testing.assert_close(values_packed, values_padded, rtol=0, atol=1e-6)
    for mode in MODES:
        for step in range(2):
            (loss, grads), (ref_loss, ref_grads) = packed[f"{mode}/{step}"], padded[f"{mode}/{step}"]
            assert loss == pytest.approx(ref_loss, abs=1e-6), (mode, step)
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=f"{mode} step {step} {name}")


def test_packed_equals_padded_in_one_process():
    """One process: log-probs, entropy, values, and two steps of every aggregation mode (losses, gradients)."""
    batch = _batch()
    _check(*_both(None, batch), batch)
    assert _batch()["attention_mask"].sum() < 0.5 * N * (P + R)  # mostly padding: the case packing is for


@pytest.mark.slow
@pytest.mark.parametrize("world,sp", [(2, 1), (4, 2), (4, 4)])
def test_packed_equals_padded_across_gloo_ranks(world, sp):
    """dp 2, dp 4 as two Ulysses groups of sp 2 and as one of sp 4: every rank's packed pass is its padded
    pass (and the padded pass at sp > 1 is sp = 1's: test_ulysses.py)."""
    results = run_distributed(_rank, world, sp)
    parallel = ParallelConfig(dp=world, sp=sp)
    parts, _ = get_protocol("DP_COMPUTE").split(Batch(_batch()), parallel)
    for rank, result in enumerate(results):
        _check(*result, parts[rank].tensors)


def test_token_budget_bins_hold_every_row_once_within_the_budget():
    lengths = _batch()["attention_mask"].sum(-1).tolist()
    for count in (0, 5, 9):
        bins = token_budget_bins(lengths, BUDGET, count)
        assert sorted(i for b in bins for i in b) == list(range(N))
        assert all(sum(lengths[i] for i in b) <= BUDGET for b in bins)
        assert len(bins) >= count and bins == token_budget_bins(lengths, BUDGET, count)  # deterministic
    fewest = len(token_budget_bins(lengths, BUDGET))
    assert fewest == -(-sum(lengths) // BUDGET)  # first-fit decreasing fills these bins without a spare one
    assert len(token_budget_bins([3, 4], 10, count=5)) == 2  # never more micro-batches than rows


def test_a_budget_below_the_longest_sequence_is_one_line():
    with pytest.raises(HflowError) as e:
        token_budget_bins([5, 40, 7], 32)
    assert "below the longest sequence (40 tokens)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(HflowError, match="below the longest"):
        FsdpEngine(tiny_model(), micro_batch_tokens=16).compute_log_probs(_batch())


def test_sequence_pack_lays_rows_back_to_back():
    batch = _batch()
    seq = pack_sequences(batch["input_ids"], batch["attention_mask"], None)
    lengths = batch["attention_mask"].sum(-1)
    assert seq.tokens == int(lengths.sum()) and seq.cu_seqlens[-1] == seq.tokens
    assert seq.position_ids[0, seq.cu_seqlens[3]] == 0 and seq.position_ids[0, seq.cu_seqlens[1] - 1] == lengths[0] - 1
    assert seq.predictor.numel() == seq.tokens - N  # every token but each sequence's last predicts the next
    holes = batch["attention_mask"].clone()
    holes[0, P] = 0  # a row whose real tokens are not one run: left to the padded pass
    assert pack_sequences(batch["input_ids"], holes, None) is None


def test_packed_with_a_sliding_window_and_grouped_kv_heads_equals_padded():
    """A window shorter than the long sequences (applied per sequence) and kv heads shared by two q heads."""
    batch = _batch(seed=4)
    over = {"sliding_window": 5, "num_key_value_heads": 2}
    padded, packed = (FsdpEngine(tiny_model(**over), micro_batch_size=4),
                      FsdpEngine(tiny_model(**over), micro_batch_tokens=BUDGET))
    real = batch["attention_mask"].bool().clone()
    real[:, 0] = False
    for key in ("log_probs", "entropy"):
        a = packed.compute_log_probs(batch, entropy=True)[key]
        torch.testing.assert_close(a[real], padded.compute_log_probs(batch, entropy=True)[key][real], rtol=0, atol=1e-6)
    values = [FsdpEngine(tiny_model(score=True, **over), **kw).compute_values(batch)["values"]
              for kw in ({"micro_batch_size": 4}, {"micro_batch_tokens": BUDGET})]
    torch.testing.assert_close(values[1], values[0], rtol=0, atol=1e-6)
