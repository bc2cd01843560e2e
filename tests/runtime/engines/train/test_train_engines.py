"""The training engines behind one interface (engines/train/base.py): picked by backend name from a
registry, the learning-rate schedule, the skipped-step guard and the checkpoint hooks written once and
shared by FSDP2 and Megatron, the run config's optimizer section reaching the engine whole."""

from __future__ import annotations

import math

import pytest
import torch
from engine_util import nll_loss, tiny_model, token_batch

from hybridflow.runtime.engines.rollout.backends import ROLLOUT_ENGINES
from hybridflow.runtime.engines.train.base import TRAIN_ENGINES, TrainEngine, build_train_engine
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.simulator.errors import HflowError

SHARED = ("learning_rate", "_set_lr", "_dp_mean", "_finish_step", "save", "load", "fingerprint")


def test_engines_and_rollout_backends_come_from_their_registries_by_name():
    assert TRAIN_ENGINES.get("fsdp") is FsdpEngine and TRAIN_ENGINES.get("FSDP") is FsdpEngine
    assert ROLLOUT_ENGINES.get("native").backend == "native"
    for registry, name, known in ((TRAIN_ENGINES, "deepspeed", "fsdp, megatron"),
                                  (ROLLOUT_ENGINES, "sglang", "native, vllm")):
        with pytest.raises(HflowError, match=f"unknown .* '{name}'; backends: {known}") as e:
            registry.get(name)
        assert "\n" not in str(e.value)


def test_both_engines_share_the_schedule_the_guard_and_the_checkpoint_hooks():
    pytest.importorskip("megatron.core", reason="megatron-core is an extra ([megatron])")
    megatron = TRAIN_ENGINES.get("megatron")
    for engine in (FsdpEngine, megatron):
        assert issubclass(engine, TrainEngine)
        for name in SHARED:  # written once, in the base: neither engine has a copy
            assert getattr(engine, name) is getattr(TrainEngine, name), (engine.__name__, name)


def test_the_optimizer_section_reaches_the_engine_whole():
    optim = OptimConfig(lr=3e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, warmup_steps=4)
    engine = build_train_engine(tiny_model(), None, optim=optim)
    assert isinstance(engine, FsdpEngine)
    for group in engine.optimizer.param_groups:
        assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.1)
    lrs = [engine.train_step(token_batch(n=2, seq=6), nll_loss)["lr"] for _ in range(6)]
    assert lrs == pytest.approx([3e-4 * k / 4 for k in (1, 2, 3, 4)] + [3e-4, 3e-4])  # linear warm-up, then flat


def test_non_finite_steps_are_skipped_and_three_in_a_row_stop_in_one_line():
    engine = FsdpEngine(tiny_model(), optim=OptimConfig(lr=1e-3, max_skipped_steps=3))
    batch = token_batch(n=2, seq=6)
    before = [p.detach().clone() for p in engine.model.parameters()]

    def nan_loss(outputs, micro):
        loss, stats = nll_loss(outputs, micro)
        return loss * float("nan"), stats

    for k in (1, 2):
        m = engine.train_step(batch, nan_loss)
        assert m["skipped"] == 1.0 and engine.step == 0 and engine.skipped_in_a_row == k
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters(), strict=True))  # untouched
    m = engine.train_step(batch, nll_loss)  # a finite step resets the count
    assert m["skipped"] == 0.0 and engine.step == 1 and engine.skipped_in_a_row == 0 and math.isfinite(m["grad_norm"])
    for _ in range(2):
        engine.train_step(batch, nan_loss)
    with pytest.raises(HflowError, match="3 optimizer steps in a row had a non-finite gradient or loss") as e:
        engine.train_step(batch, nan_loss)
    assert "\n" not in str(e.value)


def test_a_checkpoint_of_another_engine_layout_is_refused_before_reading(tmp_path):
    engine = FsdpEngine(tiny_model())
    engine.train_step(token_batch(n=2, seq=6), nll_loss)
    engine.save(tmp_path / "ck")
    other = FsdpEngine(tiny_model(seed=1))
    other.load(tmp_path / "ck")
    assert other.fingerprint() == engine.fingerprint() and other.step == 1
    with pytest.raises(HflowError, match="not a training checkpoint of this layout.*need dcp/"):
        FsdpEngine(tiny_model()).load(tmp_path)
