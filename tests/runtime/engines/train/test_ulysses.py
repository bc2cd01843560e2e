"""Ulysses sequence parallelism (engines/train/fsdp/ulysses.py) on 4 gloo processes: sp = 2 and sp = 4 train
exactly as sp = 1 (losses, gradients, weights) and score the same log-probs, entropy and values."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import engine_errors, nll_loss, tiny_model, token_batch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import get_protocol
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
from hybridflow.runtime.engines.train.fsdp.ulysses import sp_group_ranks
from hybridflow.simulator.vocabulary.lora import LoraConfig
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

pytestmark = pytest.mark.slow

STEPS = 3
OPTIM = OptimConfig(lr=3e-3, grad_clip=0.5)
N, SEQ = 8, 13  # 13 columns: padded to a multiple of sp before the split


def _batch(padded: bool) -> TensorDict:
    """Eight rows; `padded`: left-padded prompts and right-padded responses of different lengths (each row's
    real tokens one contiguous run, as RL batches are), else every token real."""
    data = token_batch(n=N, seq=SEQ)
    if padded:
        g = torch.Generator().manual_seed(2)
        left = torch.randint(0, 4, (N,), generator=g)
        right = torch.randint(0, 5, (N,), generator=g)
        cols = torch.arange(SEQ)
        data["attention_mask"] = ((cols >= left[:, None]) & (cols < SEQ - right[:, None])).long()
        data["input_ids"] = data["input_ids"] * data["attention_mask"]
    data["response_mask"] = data["attention_mask"].clone()
    data["response_mask"][:, :5] = 0
    return TensorDict(data, batch_size=[N])


def token_mean_loss(outputs, micro):
    """The token-mean over the responses (with token_weights="response_mask")."""
    mask = micro["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum().clamp(min=1)


def _grads(engine) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in engine.model.named_parameters() if p.requires_grad}


def _run(engine: FsdpEngine, batch: TensorDict, token_weights: str | None):
    loss_fn = token_mean_loss if token_weights else nll_loss
    before = engine.compute_log_probs(batch, micro_batch_size=2, entropy=True)
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(engine.train_step(batch, loss_fn, micro_batch_size=2, token_weights=token_weights)["loss"])
        grads.append(_grads(engine))
    scored = engine.compute_log_probs(batch, micro_batch_size=2, entropy=True)
    tail = engine.compute_log_probs(batch, micro_batch_size=2, score_width=6)
    return losses, grads, before, scored, tail, engine.full_state_dict()


def _local(batch: TensorDict, parallel: ParallelConfig, rank: int) -> TensorDict:
    """This rank's share as the runtime dispatches it (DP_COMPUTE: one shard per dp/sp group)."""
    parts, _ = get_protocol("DP_COMPUTE").split(Batch(batch), parallel)
    return parts[rank].tensors


def _train(rank, world, tp, dp, sp, padded, token_weights, overrides, lora=None):
    parallel = ParallelConfig(tp=tp, dp=dp, sp=sp)
    engine = FsdpEngine(tiny_model(**overrides), parallel, optim=OPTIM, lora=lora)
    return _run(engine, _local(_batch(padded), parallel, rank), token_weights)


def _reference(padded, token_weights, overrides, groups: int, lora=None):
    """sp = 1 on the same data: one rank per dp/sp group holding that group's rows (one process: the whole
    batch). A row-weighted mean of per-micro-batch means depends on how rows fall into micro-batches, so the
    reference cuts each group's rows as the sp group does."""
    if groups == 1:
        return [_run(FsdpEngine(tiny_model(**overrides), optim=OPTIM, lora=lora), _batch(padded), token_weights)]
    return run_distributed(_train, groups, 1, groups, 1, padded, token_weights, overrides, lora)


def _check(results, refs, parallel: ParallelConfig):
    for rank, (losses, grads, before, scored, tail, state) in enumerate(results):
        ref_losses, ref_grads, ref_before, ref_scored, ref_tail, ref_state = \
            refs[parallel.rank_coords(rank)[1] // parallel.sp]
        assert losses == pytest.approx(ref_losses, abs=1e-6)
        for step, (g, rg) in enumerate(zip(grads, ref_grads, strict=True)):
            for name, value in rg.items():
                torch.testing.assert_close(g[name], value, rtol=0, atol=1e-6, msg=f"step {step} {name}")
        for key in ("log_probs", "entropy"):  # the same weights: to 1e-6; after 3 steps: to fp32 rounding
            torch.testing.assert_close(before[key], ref_before[key], rtol=0, atol=1e-6)
            torch.testing.assert_close(scored[key], ref_scored[key], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(tail["log_probs"], ref_tail["log_probs"], rtol=1e-6, atol=1e-6)
        assert (tail["log_probs"][:, :SEQ - 6] == 0).any()  # score_width: columns before the scored ones hold 0
        # Adam divides by sqrt(v): a 1e-7 gradient difference on a near-zero gradient element moves it by a
        # fraction of lr (3e-3); the gradients themselves agree to 1e-6 at every step, above.
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=5e-5, msg=name)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("padded,token_weights", [(False, None), (True, None), (True, "response_mask")])
def test_sp_trains_as_sp1(sp, padded, token_weights):
    """dp 4 split into sequence-parallel groups of 2 or 4, with and without padding removal (packing.py), row- and
    token-weighted losses: every rank's losses, gradients, weights after 3 Adam steps and log-probs as sp = 1."""
    refs = _reference(padded, token_weights, {}, 4 // sp)
    assert refs[0][0][-1] < refs[0][0][0]  # it learns
    _check(run_distributed(_train, 4, 1, 4, sp, padded, token_weights, {}), refs, ParallelConfig(dp=4, sp=sp))


def test_sp_with_fewer_kv_heads_than_ranks_and_tensor_parallelism():
    """kv_heads 2 < sp 4 (each rank a copy of its kv head); and tp 2 × sp 2 (sp·tp = heads)."""
    over = {"num_key_value_heads": 2}
    _check(run_distributed(_train, 4, 1, 4, 4, True, "response_mask", over),
           _reference(True, "response_mask", over, 1), ParallelConfig(dp=4, sp=4))
    _check(run_distributed(_train, 4, 2, 2, 2, True, None, over), _reference(True, None, over, 1),
           ParallelConfig(tp=2, dp=2, sp=2))


def test_sp_with_per_head_norms_and_biases():
    """Qwen3's per-head q/k norms (applied before the exchange) and q/k/v biases, at sp 4."""
    over = {"qk_norm": True, "qkv_bias": True}
    _check(run_distributed(_train, 4, 1, 4, 4, True, None, over), _reference(True, None, over, 1),
           ParallelConfig(dp=4, sp=4))


def test_sp_trains_lora_adapters_as_sp1():
    """LoRA (adapters on q/k/v/o and the MLP, engines/train/lora.py) at sp 2 of dp 4."""
    pytest.importorskip("peft")
    lora = LoraConfig(rank=4, alpha=16)
    refs = _reference(True, "response_mask", {}, 2, lora)
    _check(run_distributed(_train, 4, 1, 4, 2, True, "response_mask", {}, lora), refs, ParallelConfig(dp=4, sp=2))


def _values(rank, world, sp, window):
    parallel = ParallelConfig(dp=4, sp=sp)
    engine = FsdpEngine(tiny_model(score=True, sliding_window=window), parallel)
    return engine.compute_values(_local(_batch(True), parallel, rank), micro_batch_size=2)["values"]


@pytest.mark.parametrize("window", [None, 4])
def test_sp_values_of_a_scalar_head(window):
    """A critic's per-token values (and a sliding window over the whole sequence, not the local slice)."""
    ref = FsdpEngine(tiny_model(score=True, sliding_window=window)).compute_values(_batch(True),
                                                                                   micro_batch_size=2)["values"]
    for rank, values in enumerate(run_distributed(_values, 4, 2, window)):
        torch.testing.assert_close(values, ref[rank // 2 * 4:(rank // 2 + 1) * 4], rtol=0, atol=1e-6)


def test_sp_groups_are_consecutive_dp_ranks_at_stride_tp():
    assert sp_group_ranks(ParallelConfig(dp=4, sp=2)) == [[0, 1], [2, 3]]
    assert sp_group_ranks(ParallelConfig(tp=2, dp=4, sp=2)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sp_group_ranks(ParallelConfig(pp=2, dp=2, sp=2)) == [[0, 1], [2, 3]]


def _bad(rank, world):
    return engine_errors(((ParallelConfig(dp=4, sp=4), {"num_attention_heads": 2, "num_key_value_heads": 2}),
                          (ParallelConfig(dp=4, sp=4), {"num_attention_heads": 12, "num_key_value_heads": 3,
                                                        "head_dim": 8})))


def test_sp_not_dividing_heads_is_one_line():
    messages = run_distributed(_bad, 4)[0]
    assert len(messages) == 2 and all("sp·tp=4 must divide heads" in m and "\n" not in m for m in messages)


def test_sp_with_a_mixture_of_experts():
    """Mixtral's routed experts (each token routed on its own rank's share of the sequence; the router's
    choice per token does not depend on where the token sits) at sp 2 of dp 4."""
    over = dict(family="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    _check(run_distributed(_train, 4, 1, 4, 2, True, "response_mask", over), _reference(True, "response_mask", over, 2),
           ParallelConfig(dp=4, sp=2))
