"""LoRA training on the FSDP engine (engines/train/lora.py) equals a hand-built peft model: the same loss and
adapter gradients step by step, the frozen weights bit-identical after training, and the base policy (adapters
off) the untouched model's — single-process and sharded (FSDP2 × TP on gloo)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import nll_loss, tiny_model, token_batch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.train.base import build_train_engine
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig, token_log_probs
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lora import LoraConfig
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

peft = pytest.importorskip("peft")

STEPS = 4
LORA = LoraConfig(rank=4, alpha=16)  # scale 4: the adapters move the loss within a few steps
OPTIM = OptimConfig(lr=1e-2, grad_clip=0.0)
SEED = 5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # llama's default


def _batch(n=8):
    return TensorDict(token_batch(n=n), batch_size=[n])


def _hand_built():
    """tiny_model with peft's adapters injected by hand, trained by a plain AdamW loop."""
    model = tiny_model()
    cfg = peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, bias="none")
    torch.manual_seed(SEED)
    peft.inject_adapter_in_model(cfg, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay)
    batch = token_batch(n=8)
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"])
        loss, _ = nll_loss({"log_probs": token_log_probs(logits, batch["input_ids"]),
                            "entropy": torch.zeros_like(logits[..., 0])}, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(engine, batch):
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(engine.train_step(batch, nll_loss)["loss"])
        grads.append({n: _whole(p.grad).clone() for n, p in engine.model.named_parameters() if p.requires_grad})
    return losses, grads


def _check(losses, grads, ref_losses, ref_grads):
    assert losses == pytest.approx(ref_losses, abs=1e-6, rel=0)
    for got, want in zip(grads, ref_grads, strict=True):
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)


def test_lora_engine_equals_hand_built_peft_model():
    ref_losses, ref_grads, ref_state = _hand_built()
    assert ref_losses[-1] < ref_losses[0] - 0.05  # the adapters learn
    base = tiny_model().state_dict()
    engine = FsdpEngine(tiny_model(), optim=OPTIM, micro_batch_size=8, lora=LORA, lora_seed=SEED)
    losses, grads = _train(engine, _batch())
    _check(losses, grads, ref_losses, ref_grads)
    state = engine.full_state_dict()
    for name, value in base.items():  # the frozen weights: bit-identical
        key = name.replace(".weight", ".base_layer.weight") if name not in state else name
        assert torch.equal(state[key], value), name
    assert sum(p.numel() for p in engine.optimizer.param_groups[0]["params"]) == 8704  # the adapters alone


def test_base_policy_is_the_untouched_model():
    engine = FsdpEngine(tiny_model(), optim=OPTIM, micro_batch_size=4, lora=LORA, lora_seed=SEED)
    batch = _batch()
    _train(engine, batch)
    plain = FsdpEngine(tiny_model(), micro_batch_size=4)
    with engine.base_policy():
        ref = engine.compute_log_probs(batch)["log_probs"]
    assert torch.equal(ref, plain.compute_log_probs(batch)["log_probs"])
    trained = engine.compute_log_probs(batch)["log_probs"]
    assert not torch.allclose(trained, ref)  # the adapters are back on after the `with`
    assert all(p.requires_grad for n, p in engine.model.named_parameters() if "lora_" in n)


def _sharded(rank, world, tp, dp):
    engine = FsdpEngine(tiny_model(), ParallelConfig(tp=tp, dp=dp), optim=OPTIM, micro_batch_size=4, lora=LORA,
                        lora_seed=SEED)
    full = _batch()
    per = 8 // dp
    local = full[engine.dp_rank * per:(engine.dp_rank + 1) * per]
    losses, grads = _train(engine, local)
    with engine.base_policy():
        ref = engine.compute_log_probs(local)["log_probs"]
    return losses, grads, engine.full_state_dict(), ref, engine.dp_rank


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", [(2, 2)])
def test_sharded_lora_equals_hand_built_peft_model(tp, dp):
    ref_losses, ref_grads, _ = _hand_built()
    base = tiny_model().state_dict()
    plain = FsdpEngine(tiny_model(), micro_batch_size=8).compute_log_probs(_batch())["log_probs"]
    for losses, grads, state, ref, dp_rank in run_distributed(_sharded, tp * dp, tp, dp):
        _check(losses, grads, ref_losses, ref_grads)
        for name, value in base.items():
            key = name.replace(".weight", ".base_layer.weight") if name not in state else name
            assert torch.equal(state[key], value), name
        torch.testing.assert_close(ref, plain[dp_rank * 4:(dp_rank + 1) * 4], rtol=0, atol=1e-6)


def test_megatron_lora_is_refused_in_one_line():
    with pytest.raises(HflowError, match="LoRA trains on the fsdp backend only"):
        build_train_engine(tiny_model(), ParallelConfig(backend="megatron"), lora=LORA)


def test_critic_lora_trains_adapters_and_its_fresh_head_only():
    def value_loss(outputs, micro):
        return ((outputs["values"] - 1.0) ** 2).mean()

    base = tiny_model(score=True).state_dict()
    engine = FsdpEngine(tiny_model(score=True), optim=OPTIM, micro_batch_size=8, lora=LORA, lora_seed=SEED)
    trained = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trained == {n for n in trained if "lora_" in n or n.startswith("score.")} and "score.weight" in trained
    losses = [engine.train_step(_batch(), value_loss)["loss"] for _ in range(STEPS)]
    assert losses[-1] < losses[0]
    state = engine.full_state_dict()
    for name, value in base.items():
        key = name.replace(".weight", ".base_layer.weight") if name not in state else name
        assert torch.equal(state[key], value) == (not name.startswith("score.")), name
