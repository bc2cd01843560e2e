"""cpu_kernels.c (built with the system's C compiler, loaded with ctypes) against torch's ops: each
kernel to float rounding, and the fused decoder's C path against its torch path over runs that
cross the cache's pages, with padding, grouped-query heads, Qwen3's q/k norms and rows leaving."""

import os
import subprocess

import pytest
import torch

from hybridflow.runtime.engines.cpu_decode import cpu_kernels, fast_decode, token_pick
from hybridflow.runtime.engines.rollout import generation
from hybridflow.runtime.engines.rollout.generation import (
    GenerationEngine,
    SamplingParams,
    left_pad,
    sample_tokens,
)
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.vocabulary.model import model_preset

C = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(C is None, reason="no C compiler here: the fused path runs torch's ops")


@pytest.fixture(autouse=True)
def one_thread():
    """The fused path takes the C kernels with one torch thread (as the rollout workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_build_caches_one_library_per_source_and_cpu(tmp_path):
    first = cpu_kernels.build(tmp_path)
    assert first == cpu_kernels.library_path(tmp_path) and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build(tmp_path).stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [f.name for f in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_a_failing_compiler_raises_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(subprocess.CalledProcessError):
        cpu_kernels.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_loading_the_kernels_keeps_subnormal_floats():
    """The library is compiled with -ffast-math but not linked with it: loading it must not switch the
    process to flush-to-zero (torch's and numpy's float ops keep their subnormals)."""
    code = ("import numpy as np, torch; from hybridflow.runtime.engines.cpu_decode import cpu_kernels; "
            "assert cpu_kernels.kernels() is not None; "
            "tiny = np.float32(1e-38); print(float(tiny * np.float32(1e-3)), float(torch.tensor(1e-38) * 1e-3))")
    out = subprocess.run(["python", "-c", code], capture_output=True, text=True, check=True)
    assert all(float(v) > 0 for v in out.stdout.split()), out.stdout


def test_kernels_can_be_switched_off():
    env = dict(os.environ, HFLOW_CPU_KERNELS="0")
    out = subprocess.run(["python", "-c", "from hybridflow.runtime.engines.cpu_decode import cpu_kernels; "
                          "print(cpu_kernels.kernels())"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("rows, n", [(1, 32), (5, 128), (64, 256)])
def test_rms_norm_and_silu_mul_equal_torch(rows, n):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3 * n, generator=g)[:, :n]  # rows with a stride, as a prefill's last positions
    eps = n * 1e-6
    out = torch.empty(rows, n)
    C.rms_norm(x.data_ptr(), x.stride(0), rows, n, eps, out.data_ptr())
    assert torch.allclose(out, x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt(), atol=1e-6, rtol=1e-5)
    gu = torch.randn(rows, 2 * n, generator=g) * 4
    out = torch.empty(rows, n)
    C.silu_mul(gu.data_ptr(), gu.stride(0), rows, n, out.data_ptr())
    gate, up = gu.chunk(2, -1)
    assert torch.allclose(out, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [7, 64, 8192, 8199])
def test_greedy_pick_is_argmax_and_its_log_prob(vocab):
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    # ties: the first index wins, as in torch — in another vector lane than the later one (row 2), in
    # the same lane (row 3), in the tail past the whole vectors (row 4)
    logits[2, vocab // 2] = logits[2, -1] = logits[2].max() + 1
    logits[3, 3] = logits[3, 3 + 16 * (vocab // 32)] = logits[3].max() + 1
    logits[4, -1] = logits[4, -2] = logits[4].max() + 1
    tokens, logp = sample_tokens(logits, SamplingParams(greedy=True))
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[2] == vocab // 2 and tokens[3] == 3
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1), atol=1e-6)


@pytest.mark.parametrize("vocab", [64, 8192])
@pytest.mark.parametrize("params", [dict(temperature=0.8, top_k=20, top_p=0.9), dict(), dict(top_k=5),
                                    dict(temperature=1.3, top_k=50, top_p=0.5), dict(top_k=1)])
def test_sample_pick_draws_what_torch_draws(vocab, params):
    """The same uniforms pick the same tokens as torch's top-k / top-p / inverse-CDF (bar a draw
    landing within float rounding of a step's edge), with the same log-probs."""
    params = SamplingParams(**params)
    logits = torch.randn(400, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    rows = torch.arange(0, 800, 2)  # rows of a batch of 800, as when finished rows have left
    got = generation._pick_c(logits, params, torch.Generator().manual_seed(1), rows, 800)
    want = generation._sample_torch(logits, params, torch.Generator().manual_seed(1), rows, 800)
    assert got is not None
    assert (got[0] == want[0]).float().mean() >= 0.995
    scaled = torch.log_softmax(logits / params.temperature, -1)
    assert torch.allclose(got[1], scaled.gather(1, got[0][:, None]).squeeze(1), atol=1e-5)


def test_sample_pick_leaves_the_whole_vocabulary_sort_to_torch():
    logits = torch.randn(4, 100)
    assert generation._pick_c(logits, SamplingParams(top_p=0.9), None, None, 0) is None
    assert generation._pick_c(logits, SamplingParams(top_k=token_pick.C_MAX_TOP_K + 1, top_p=0.9), None, None, 0) is None
    assert generation._pick_c(logits.double(), SamplingParams(top_k=5), None, None, 0) is None


def _model(seed=0, **shape) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2, **shape)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a dropped term shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("shape", [dict(), dict(num_key_value_heads=2), dict(num_key_value_heads=1, qkv_bias=True),
                                   dict(family="qwen3", qk_norm=True, num_key_value_heads=2),
                                   # head_dim 64 (whole double pages of V), 96 (one and a tail); 6 query
                                   # heads per kv head (attended four, then two, together)
                                   dict(hidden_size=256, num_key_value_heads=2), dict(hidden_size=384, num_key_value_heads=1),
                                   dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=1)])
def test_c_path_equals_torch_path_across_pages(shape):
    """Prefill (prompts over two pages of CHUNK, starting mid-page), then decode steps to 75 cache slots
    (three pages), rows leaving half way: the C path's logits equal the torch path's to 1e-5 at every step."""
    model = _model(**shape)
    prompts = [[5, 9, 2, 33, 7, 1] * 5, [4, 8], [60, 3, 3, 11] * 3, [17], [8, 8, 8, 2, 40] * 9, [1, 2, 3]]
    ids, mask = left_pad(prompts)
    b, p, r = ids.shape[0], ids.shape[1], 75 - ids.shape[1]
    neg = torch.finfo(torch.float32).min
    from hybridflow.runtime.models.decoder import attention_bias_mask, positions_from_mask

    key_mask = torch.cat([mask.bool(), torch.ones(b, r, dtype=torch.bool)], dim=1)
    positions = positions_from_mask(mask)
    prefill_mask = torch.zeros(b, 1, p, p).masked_fill_(~attention_bias_mask(key_mask, p, 0), neg)
    real = mask.reshape(-1).nonzero().squeeze(1)
    decoders = [fast_decode.FusedDecoder(model, b, p + r, c_kernels=use_c) for use_c in (True, False)]
    assert decoders[0].c is not None and decoders[1].c is None
    with torch.no_grad():
        logits = [dec.prefill(ids, dec.rotations(positions), prefill_mask, real) for dec in decoders]
        step_mask = torch.zeros(b, 1, p + r).masked_fill_(~key_mask[:, None], neg).repeat_interleave(
            decoders[0].kv_heads, 0)
        rows = torch.arange(b)
        for t in range(r):
            assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0), (t, (logits[0] - logits[1]).abs().max())
            if t == r // 2:  # rows 1 and 4 finish: the cache keeps the others
                keep = torch.tensor([0, 2, 3, 5])
                for dec in decoders:
                    dec.keep_rows(keep)
                rows, step_mask = rows[keep], step_mask.unflatten(0, (b, -1))[keep].flatten(0, 1)
                b = len(keep)
                logits = [x[keep] for x in logits]
            tokens = logits[1].argmax(-1)
            pos = positions[rows, -1:] + 1 + t
            logits = [dec.decode(tokens, dec.rotations(pos)[:, 0], step_mask) for dec in decoders]
    assert decoders[0].length == p + r


def test_generate_through_c_kernels_equals_module_path():
    """Whole rollouts (greedy, sampled, rows ending at EOS and leaving the batch) through the C path
    give the module path's tokens and log-probs."""
    model = _model(num_key_value_heads=2)
    ids, mask = left_pad([[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11], [9] * 20])
    for params in (SamplingParams(max_new_tokens=40, greedy=True),
                   SamplingParams(max_new_tokens=40, temperature=0.9, top_k=12, top_p=0.9, eos_token_id=[5, 7])):
        fast = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(4))
        slow = GenerationEngine(model, fast_decode=False).generate(ids, mask, params, torch.Generator().manual_seed(4))
        assert torch.equal(fast.response, slow.response) and torch.equal(fast.response_mask, slow.response_mask)
        assert torch.allclose(fast.response_logprobs, slow.response_logprobs, atol=1e-5)


def test_the_cache_and_weights_memory_is_kept_from_call_to_call():
    """The engine's C-path KV cache and packed weights come from its KeptMemory: the same memory on
    the next calls (no fresh pages; the weights' block from the second call on, sized by the first),
    the cache grown for a bigger batch, with the same outputs every time."""
    model = _model(num_key_value_heads=2)
    engine = GenerationEngine(model)
    ids, mask = left_pad([[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11]])
    params = SamplingParams(max_new_tokens=40, greedy=True)
    first = engine.generate(ids, mask, params).response
    memory = engine.memory
    assert memory._weights is None and memory._asked > 0  # the first call's panels apart, their size noted
    cache, size = memory._cache.data_ptr(), memory._cache.numel()
    assert torch.equal(engine.generate(ids, mask, params).response, first)
    weights = memory._weights.data_ptr()
    assert memory._offset == memory._asked == memory._weights.numel()  # every panel in the block
    assert torch.equal(engine.generate(ids, mask, params).response, first)
    assert memory._weights.data_ptr() == weights and memory._cache.data_ptr() == cache
    bigger = engine.generate(*left_pad([[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11]] * 3), params).response
    assert torch.equal(bigger[:3], first) and memory._cache.numel() > size
