"""The native KV-cache generation engine: greedy parity (full recompute and HF generate), log-probs
equal a teacher-forced recompute, EOS handling, sampling distributions, determinism, the fused path
(fast_decode.py) against the module path (logits and tokens, weight updates seen), and the same
tokens from a tensor-parallel (tp = 2, gloo) model as from one process."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_distributed

from hybridflow.runtime.engines.cpu_decode import fast_decode, matmul_kernels
from hybridflow.runtime.engines.rollout.generation import (
    GenerationEngine,
    SamplingParams,
    left_pad,
    sample_tokens,
)
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import model_preset

torch.set_num_threads(1)
PROMPTS = [[5, 9, 2, 33, 7, 1], [4, 8], [60, 3, 3, 11]]


def _model(kv_heads: int = 2, seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = model_preset("tiny").decoder_config(num_key_value_heads=kv_heads, num_hidden_layers=2)
    return CausalLM(cfg).eval()


def _greedy_by_recompute(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_greedy_equals_full_recompute(kv_heads):
    model = _model(kv_heads)
    ids, mask = left_pad(PROMPTS)
    out = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=10, greedy=True))
    assert out.response.shape == (3, 10) and out.tokens.shape == (3, ids.shape[1] + 10)
    for i, prompt in enumerate(PROMPTS):
        assert out.response[i].tolist() == _greedy_by_recompute(model, prompt, 10)
    assert out.response_mask.all()


def test_greedy_equals_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hybridflow.runtime.models.hf_format import save_pretrained

    model = _model()
    save_pretrained(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, mask = left_pad(PROMPTS)
    gen_cfg = transformers.GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
    out = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=12, greedy=True))
    assert torch.equal(out.tokens, ref)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=9, temperature=0.7),
    SamplingParams(max_new_tokens=9, temperature=1.3, top_k=8, top_p=0.8),
    SamplingParams(max_new_tokens=9, greedy=True),
])
def test_logprobs_equal_teacher_forced_recompute(params):
    """What a trainer recomputes from the rollout (tokens, mask, positions) is what we returned."""
    model = _model()
    ids, mask = left_pad(PROMPTS)
    out = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(out.tokens, attention_mask=out.attention_mask, position_ids=out.position_ids)
    p = ids.shape[1]
    temp = 1.0 if params.is_greedy else params.temperature
    logp = torch.log_softmax(logits[:, p - 1:-1] / temp, dim=-1).gather(2, out.response[..., None]).squeeze(-1)
    assert torch.allclose(logp * out.response_mask, out.response_logprobs, atol=1e-5)
    if params.top_k:  # every sampled token is among the top-k of its step
        ranks = (logits[:, p - 1:-1] > logits[:, p - 1:-1].gather(2, out.response[..., None])).sum(-1)
        assert int(ranks.max()) < params.top_k


def test_eos_stops_a_row_and_pads_after_it():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    greedy = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=8, greedy=True))
    eos = int(greedy.response[0, 2])  # row 0 emits this as its third token
    params = SamplingParams(max_new_tokens=8, greedy=True, eos_token_id=[eos, 999], pad_token_id=63)
    out = GenerationEngine(model).generate(ids, mask, params)
    for i in range(3):
        row = greedy.response[i].tolist()
        n = row.index(eos) + 1 if eos in row else 8
        assert out.response_mask[i].tolist() == [1] * n + [0] * (8 - n)
        assert out.response[i, :n].tolist() == row[:n]
        assert (out.response[i, n:] == 63).all() and (out.response_logprobs[i, n:] == 0).all()
    n0 = greedy.response[0].tolist().index(eos) + 1
    assert n0 <= 3 and out.response_lengths[0] == n0
    all_stop = GenerationEngine(model).generate(ids[:1], mask[:1], params)
    assert all_stop.response.shape == (1, 8) and all_stop.response_mask.sum() == n0  # stopped early, padded


def test_finished_rows_leave_the_batch_with_the_same_outputs():
    """Rows that emitted EOS are dropped from the fused path's batch (a quarter at a time); the
    tokens and masks equal a run that computes all rows to the end, greedy and sampled (the noise is
    drawn per full batch, so no row's draw depends on the others), the log-probs to float rounding
    (a matmul over fewer rows may take another BLAS kernel, which adds in another order)."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    ids, mask = left_pad(prompts)
    greedy = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=16, greedy=True))
    eos = int(greedy.response[0, 1])  # row 0 ends at its second token; others later or never
    cases = [SamplingParams(max_new_tokens=16, greedy=True, eos_token_id=eos),
             SamplingParams(max_new_tokens=16, temperature=1.0, eos_token_id=[3, 7, 11, 50]),
             SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, eos_token_id=[3, 7, 11, 50])]
    for params in cases:
        dropping, keeping = GenerationEngine(model), GenerationEngine(model, drop_finished=False)
        a = dropping.generate(ids, mask, params, torch.Generator().manual_seed(5))
        b = keeping.generate(ids, mask, params, torch.Generator().manual_seed(5))
        for field in ("response", "response_mask"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (params, field)
        assert torch.allclose(a.response_logprobs, b.response_logprobs, rtol=0, atol=1e-5), params
        lengths = a.response_lengths
        assert lengths.min() < lengths.max() and lengths.max() > 2  # rows end at different steps
        assert set(keeping.last_batch_sizes) == {8}
        assert dropping.last_batch_sizes[-1] < 8 and sorted(dropping.last_batch_sizes, reverse=True) == \
            dropping.last_batch_sizes  # rows left the batch, and none came back
        # each step computed at least the rows still generating at that step
        live = (a.response_mask[:, 1:len(dropping.last_batch_sizes) + 1] == 1).sum(0)
        assert all(n >= int(k) for n, k in zip(dropping.last_batch_sizes, live, strict=True))


def test_rows_of_very_different_prompt_widths_leave_the_batch_with_the_same_outputs():
    """Partial rollouts' calls: continued rows carry long prefixes beside short new prompts, so the rows
    fill different numbers of the C cache's pages; a dropped batch copies each kept row's own pages
    (FusedDecoder.keep_rows) and decodes exactly what the run keeping every row decodes."""
    model = _model()
    g = torch.Generator().manual_seed(4)
    widths = [3, 200, 5, 130, 70, 9, 2, 150, 40, 95]  # 1 to 7 pages of cpu_kernels.CHUNK slots
    ids, mask = left_pad([torch.randint(1, 64, (n,), generator=g).tolist() for n in widths])
    lengths = torch.tensor([2, 30, 4, 6, 30, 3, 9, 12, 5, 20])  # rows end at different steps: several drops
    params = SamplingParams(max_new_tokens=30, temperature=1.0)
    dropping, keeping = GenerationEngine(model), GenerationEngine(model, drop_finished=False)
    a = dropping.generate(ids, mask, params, torch.Generator().manual_seed(5), lengths)
    b = keeping.generate(ids, mask, params, torch.Generator().manual_seed(5), lengths)
    assert torch.equal(a.response, b.response) and torch.equal(a.response_mask, b.response_mask)
    assert torch.allclose(a.response_logprobs, b.response_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(a.response_lengths, lengths)
    assert len(set(dropping.last_batch_sizes)) >= 3  # rows left the batch more than once


def test_seeded_generation_is_deterministic():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95)
    a = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(1))
    b = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(1))
    c = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(2))
    assert torch.equal(a.response, b.response) and torch.equal(a.response_logprobs, b.response_logprobs)
    assert not torch.equal(a.response, c.response)


def test_sampling_follows_the_truncated_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    n = 40000
    batch = logits.expand(n, -1)
    g = torch.Generator().manual_seed(0)
    cases = [(SamplingParams(temperature=0.5), None), (SamplingParams(top_k=3), 3),
             (SamplingParams(top_p=0.7), None)]
    for params, k in cases:
        probs = torch.softmax(logits[0] / params.temperature, -1)
        if k:
            probs[k:] = 0
        if params.top_p < 1:
            keep = (probs.cumsum(0) - probs) <= params.top_p
            probs = probs * keep
        probs = probs / probs.sum()
        tokens, _ = sample_tokens(batch, params, g)
        freq = torch.bincount(tokens, minlength=6).float() / n
        assert (freq - probs).abs().max() < 0.012, (params, freq, probs)
    # top-k 1 and a tiny top-p are greedy.
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        assert (sample_tokens(batch[:50], params, g)[0] == 0).all()


def test_draw_follows_softmax_and_is_per_row():
    """`_draw` (inverse CDF, one uniform per row): frequencies match the softmax over probabilities
    spanning four decades, masked (-inf) entries are never drawn, and rows drawn out of a bigger
    batch (`rows`, `batch`) get what those rows get when the whole batch draws."""
    from hybridflow.runtime.engines.rollout.generation import _draw

    logits = torch.linspace(0.0, -9.0, 64)
    logits[5::6] = float("-inf")
    probs = torch.softmax(logits, -1)
    n = 100_000
    freq = torch.bincount(_draw(logits.expand(n, -1), torch.Generator().manual_seed(0)), minlength=64).float() / n
    assert freq[probs == 0].sum() == 0
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-6).all(), (freq - probs).abs().max()
    batch = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([1, 4, 5, 7])
    for seed in range(5):
        whole = _draw(batch, torch.Generator().manual_seed(seed))
        assert torch.equal(_draw(batch[rows], torch.Generator().manual_seed(seed), rows, 8), whole[rows])


FUSED_SHAPES = [dict(num_key_value_heads=2),
                dict(qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True),
                dict(family="qwen3", qk_norm=True, num_key_value_heads=2)]


@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_fast_decode_step_equals_module_path(shape):
    torch.manual_seed(0)
    model = CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2, **shape)).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a dropped term would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    assert fast_decode.supports(model, 32)
    ids, mask = left_pad(PROMPTS)
    for params in (SamplingParams(max_new_tokens=10, greedy=True),
                   SamplingParams(max_new_tokens=10, temperature=0.9, top_k=12, eos_token_id=5)):
        fast = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(4))
        slow = GenerationEngine(model, fast_decode=False).generate(ids, mask, params,
                                                                   torch.Generator().manual_seed(4))
        assert torch.equal(fast.response, slow.response) and torch.equal(fast.response_mask, slow.response_mask)
        assert torch.allclose(fast.response_logprobs, slow.response_logprobs, atol=1e-5)


# 18 rows: more than matmul_kernels.ROW_MAJOR_MAX_BATCH, so the weights stay [out, in] (transposed views)
@pytest.mark.parametrize("shape, copies", [(s, 1) for s in FUSED_SHAPES] + [(FUSED_SHAPES[1], 6)])
def test_fused_logits_equal_module_logits(shape, copies):
    """Prefill and each decode step of `FusedDecoder` (fused q|k|v and gate|up, folded norms, paired
    RoPE, (batch, kv head) cache) give the module path's logits to 1e-5, padded rows included, with
    the weights in each layout (the C kernel's panels at a few rows where it builds, else row-major
    [in, out]; [out, in] at more)."""
    from hybridflow.runtime.models.decoder import KVCache, attention_bias_mask, positions_from_mask

    torch.manual_seed(0)
    model = CausalLM(model_preset("tiny").decoder_config(num_hidden_layers=2, **shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    ids, mask = left_pad(PROMPTS * copies)
    b, p, r = ids.shape[0], ids.shape[1], 5
    key_mask = torch.cat([mask.bool(), torch.ones(b, r, dtype=torch.bool)], dim=1)
    positions = positions_from_mask(mask)
    fused = fast_decode.FusedDecoder(model, b, p + r)
    panels = matmul_kernels.matmul_kind(model.lm_head.weight, b, panels=True) == "panel"
    assert isinstance(fused.lm_head, matmul_kernels.Panels) == panels
    if not panels:
        assert fused.lm_head.is_contiguous() == (b <= matmul_kernels.ROW_MAJOR_MAX_BATCH)
    neg = torch.finfo(torch.float32).min
    prefill_mask = torch.zeros(b, 1, p, p).masked_fill_(~attention_bias_mask(key_mask, p, 0), neg)
    step_mask = torch.zeros(b, 1, p + r).masked_fill_(~key_mask[:, None], neg)
    step_mask = step_mask.repeat_interleave(fused.kv_heads, 0)  # one row per (batch, kv head)
    cache = KVCache(2, p + r)
    with torch.no_grad():
        want = model(ids, key_mask, positions, cache, last_only=True)[:, -1]
        got = fused.prefill(ids, fused.rotations(positions), prefill_mask)
        for t in range(r + 1):
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (t, (got - want).abs().max())
            if t == r:
                break
            tokens = want.argmax(-1)
            pos = positions[:, -1:] + 1 + t
            want = model(tokens[:, None], key_mask, pos, cache, last_only=True)[:, -1]
            got = fused.decode(tokens, fused.rotations(pos)[:, 0], step_mask)
    assert fused.length == p + r


def test_fused_path_sees_weight_updates_between_generations():
    """The fused weights are rebuilt from the live parameters at every generate() call."""
    model = _model()
    engine = GenerationEngine(model)
    ids, mask = left_pad(PROMPTS)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(ids, mask, params)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # flips every logit: greedy picks other tokens
        model.model.layers[0].mlp.up_proj.weight.add_(0.05)
    after = engine.generate(ids, mask, params)
    reference = GenerationEngine(model, fast_decode=False).generate(ids, mask, params)
    assert not torch.equal(before.response, after.response)
    assert torch.equal(after.response, reference.response)
    assert torch.allclose(after.response_logprobs, reference.response_logprobs, atol=1e-5)


def test_fast_decode_is_skipped_when_modules_must_run():
    model = _model()
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert not fast_decode.supports(model, 32)
    handle.remove()
    assert fast_decode.supports(model, 32)

    class Wrapped(CausalLM):
        pass

    assert not fast_decode.supports(Wrapped(model.config), 32)
    # A sliding window the run reaches: the modules mask it, the fused path would not.
    windowed = CausalLM(model.config.model_copy(update={"family": "mistral", "sliding_window": 16}))
    assert fast_decode.supports(windowed, 16) and not fast_decode.supports(windowed, 17)


def test_rollout_batch_and_input_errors():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    out = GenerationEngine(model).generate(ids, mask, SamplingParams(max_new_tokens=4, greedy=True))
    td = out.to_tensordict()
    assert td.batch_size == torch.Size([3]) and torch.equal(td["tokens"], out.tokens)
    assert out.position_ids[1].tolist()[-6:] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(HflowError, match="left-padded"):
        GenerationEngine(model).generate(ids, mask.flip(-1))
    with pytest.raises(HflowError, match="at least one token"):
        left_pad([[1], []])


# ---- tensor parallel (tp = 2 on gloo): the same tokens as one process --------------------------


def _tp_worker(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + n: ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                         "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")})
        plan.update({p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    assert not fast_decode.supports(model, 32)  # DTensor weights: the sharded modules run
    ids, mask = left_pad(PROMPTS)
    engine = GenerationEngine(model)
    greedy = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, greedy=True))
    sampled = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, top_k=10),
                              torch.Generator().manual_seed(5))
    local_kv_heads = model.model.layers[0].self_attn.k_proj.weight.to_local().shape[0] // 32
    return greedy.response, sampled.response, local_kv_heads


@pytest.mark.slow
def test_tensor_parallel_generation_matches_one_process():
    ids, mask = left_pad(PROMPTS)
    engine = GenerationEngine(_model())
    greedy = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, greedy=True))
    sampled = engine.generate(ids, mask, SamplingParams(max_new_tokens=10, top_k=10),
                              torch.Generator().manual_seed(5))
    result = run_distributed(_tp_worker, 2)
    for rank in (0, 1):
        tp_greedy, tp_sampled, local_kv_heads = result[rank]
        assert local_kv_heads == 1  # each rank holds half of the 2 kv heads
        assert torch.equal(tp_greedy, greedy.response)
        assert torch.equal(tp_sampled, sampled.response)


def test_fused_path_with_big_weights_equals_module_path():
    """A gate|up weight big enough for oneDNN's packed linear from 2 rows (`matmul_kernels.matmul_kind`):
    the same tokens and log-probs as the modules, greedy and sampled, with rows leaving the batch at
    EOS down to one (the packed layout kept for the last rows)."""
    torch.manual_seed(0)
    cfg = model_preset("tiny").decoder_config(num_hidden_layers=2, intermediate_size=1024, mlp_bias=True)
    model = CausalLM(cfg).eval()
    assert 2 * cfg.intermediate_size * cfg.hidden_size >= matmul_kernels.PACKED_MIN_SIZE
    ids, mask = left_pad(PROMPTS)
    for params in (SamplingParams(max_new_tokens=10, greedy=True),
                   SamplingParams(max_new_tokens=10, temperature=0.9, top_k=12, eos_token_id=[5, 9, 17])):
        # seed 6: its sampled rows end after 1 and 2 tokens (the draws of `generation._draw`)
        engine = GenerationEngine(model)
        fast = engine.generate(ids, mask, params, torch.Generator().manual_seed(6))
        slow = GenerationEngine(model, fast_decode=False).generate(ids, mask, params,
                                                                   torch.Generator().manual_seed(6))
        assert torch.equal(fast.response, slow.response) and torch.equal(fast.response_mask, slow.response_mask)
        assert torch.allclose(fast.response_logprobs, slow.response_logprobs, atol=1e-5)
    assert engine.last_batch_sizes[0] == 2 and engine.last_batch_sizes[-1] == 1  # rows left: 3 -> 2 -> 1
