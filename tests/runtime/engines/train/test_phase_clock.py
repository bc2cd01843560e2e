"""The engines' phase clocks (the step breakdown's source): off, they record nothing; on, generation
splits into weight fusion, prefill, decode and sampling and a training step into forward, backward and
optimizer, each with the work it did (tokens computed, the attention context they read)."""

import torch

from hybridflow.runtime.engines.phase_clock import PhaseClock
from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams, left_pad
from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.vocabulary.model import model_preset

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13]]


def _model():
    torch.manual_seed(0)
    return CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2)).eval()


def test_clock_is_off_by_default_and_take_zeroes_it():
    clock = PhaseClock()
    with clock.span("a"):
        clock.count("tokens", 3)
    assert clock.take() == {}
    clock.enabled = True
    with clock.span("a"):
        clock.count("tokens", 3)
        with clock.span("b"):
            clock.count("tokens", 2)
    got = clock.take()
    assert got["a.tokens"] == 3 and got["b.tokens"] == 2 and got["a"] >= got["b"] > 0
    assert clock.take() == {}


def test_generation_phases_and_their_work_on_both_paths():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    b, p, r = 3, 5, 6
    params = SamplingParams(max_new_tokens=r, temperature=1.0)
    for fast in (True, False):
        engine = GenerationEngine(model, fast_decode=fast)
        untimed = engine.generate(ids, mask, params, torch.Generator().manual_seed(3))
        assert engine.clock.take() == {}
        engine.clock.enabled = True
        timed = engine.generate(ids, mask, params, torch.Generator().manual_seed(3))
        assert torch.equal(untimed.response, timed.response)  # timing changes nothing
        got = engine.clock.take()
        assert all(got[k] > 0 for k in ("prefill", "decode", "sample"))
        assert ("fuse_weights" in got) == fast
        # the fused path's prefill runs its matmuls on the prompts' real tokens only
        assert got["prefill.tokens"] == (int(mask.sum()) if fast else b * p)
        assert got["prefill.context"] == b * p * (p + 1) / 2
        assert got["decode.calls"] == r - 1 and got["decode.tokens"] == b * (r - 1)
        assert got["decode.context"] == b * sum(range(p + 1, p + r))  # the first new token reads p + 1 keys


def test_training_phases_count_the_tokens_each_pass_computes():
    engine = FsdpEngine(_model().train(), micro_batch_size=2)
    ids, mask = left_pad([[3] * 6, [4] * 2, [5] * 5])  # real lengths 6, 2, 5
    batch = {"input_ids": ids, "attention_mask": mask}
    engine.clock.enabled = True
    engine.compute_log_probs(batch)
    engine.train_step(batch, lambda out, micro: -out["log_probs"].mean())
    got = engine.clock.take()
    # micro-batches by length: [2, 5] packed to width 5, then [6]: 16 tokens computed, 13 real
    for phase in ("infer", "forward"):
        assert got[f"{phase}.tokens"] == 2 * 5 + 6 and got[f"{phase}.real_tokens"] == 13
        assert got[f"{phase}.context"] == 2 * 15 + 21
    assert all(got[k] > 0 for k in ("infer", "forward", "backward", "optimizer"))
