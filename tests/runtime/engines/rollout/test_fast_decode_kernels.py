"""The fused path's matmul kernels (matmul_kernels.matmul_kind): each kernel computes the linear, the
rule picks them at the row counts where it changes, and generation with them gives the module
path's tokens and log-probs, for a llama- and a qwen2-shaped model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.runtime.engines.cpu_decode import cpu_kernels, fast_decode, matmul_kernels
from hybridflow.runtime.engines.rollout.generation import (
    GenerationEngine,
    SamplingParams,
    left_pad,
    sample_tokens,
)
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.vocabulary.model import model_preset

torch.set_num_threads(1)


def test_kernel_rule_at_its_boundaries():
    big = torch.empty(matmul_kernels.PACKED_MIN_SIZE // 128, 128)
    small = torch.empty(big.shape[0] // 2, 128)
    assert [matmul_kernels.matmul_kind(big, rows) for rows in (1, 2, 64)] == ["row_major", "packed", "packed"]
    rows = (1, matmul_kernels.ROW_MAJOR_MAX_BATCH, matmul_kernels.ROW_MAJOR_MAX_BATCH + 1,
            matmul_kernels.PACKED_MIN_ROWS - 1, matmul_kernels.PACKED_MIN_ROWS)
    assert [matmul_kernels.matmul_kind(small, r) for r in rows] == ["row_major", "row_major", "view", "view", "packed"]
    # for a single matmul (a prefill) a weight is packed only from PACKED_MIN_ROWS rows
    assert [matmul_kernels.matmul_kind(big, r, once=True) for r in (16, 64, matmul_kernels.PACKED_MIN_ROWS)] == \
        ["row_major", "view", "packed"]
    # oneDNN only where it was measured: fp32 on CPU
    assert matmul_kernels.matmul_kind(big.double(), 64) == "view"
    # the C kernel's panels where the caller allows them and the library builds: up to PANEL_MAX_ROWS
    # rows, and at any row count with its 8-row AVX-512 tile
    if matmul_kernels.c_matmul_ready(big):
        wide = cpu_kernels.kernels().panel_tile_rows() >= 8
        assert [matmul_kernels.matmul_kind(small, r, panels=True) for r in (1, matmul_kernels.PANEL_MAX_ROWS)] == \
            ["panel", "panel"]
        assert matmul_kernels.matmul_kind(big, matmul_kernels.PANEL_MAX_ROWS + 1, panels=True) == \
            ("panel" if wide else "packed")
        assert matmul_kernels.matmul_kind(small, matmul_kernels.PACKED_MIN_ROWS, once=True, panels=True) == \
            ("panel" if wide else "packed")


@pytest.mark.parametrize("kind", matmul_kernels.MATMUL_KINDS)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_linear_equals_addmm_for_every_kernel(kind, rows):
    """`linear` over each kernel's operand gives x @ W.T + bias + residual, for any row count (a
    packed weight laid out for 8 rows runs on fewer or more; panels past their row group of 4)."""
    if kind == "panel" and not matmul_kernels.c_matmul_ready(torch.empty(1)):
        pytest.skip("the C kernels are not built here (no compiler, or HFLOW_CPU_KERNELS=0)")
    torch.manual_seed(rows)
    weight = torch.randn(100, 64)  # [out, in]; 100 outputs: the last panel partly filled
    x, bias, residual = torch.randn(rows, 64), torch.randn(100), torch.randn(rows, 100)
    w = matmul_kernels.matmul_operand(weight, kind, 8)
    want = x @ weight.t()
    for got, ref in ((matmul_kernels.linear(x, w), want), (matmul_kernels.linear(x, w, bias), want + bias),
                     (matmul_kernels.linear(x, w, None, residual), want + residual),
                     (matmul_kernels.linear(x, w, bias, residual), want + bias + residual)):
        assert got.shape == (rows, 100) and got.is_contiguous()
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 12, 300])
def test_panels_fuse_the_norm_before_and_silu_up_after(rows):
    """The panel kernel's fused steps equal them done apart: each row RMS-normalised before the
    matmul (x / sqrt(sum(x²) + n·eps)), and a gate|up weight's silu(gate)·up after it (bias halves
    included; 100 features per half: a partly filled last panel in each). 300 rows: two passes of
    the kernel's row block."""
    if not matmul_kernels.c_matmul_ready(torch.empty(1)):
        pytest.skip("the C kernels are not built here (no compiler, or HFLOW_CPU_KERNELS=0)")
    torch.manual_seed(rows)
    eps = 64 * 1e-6
    x, weight, bias = 3 * torch.randn(rows, 64), torch.randn(200, 64), torch.randn(200)
    normed = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    residual = torch.randn(rows, 200)
    plain = matmul_kernels.Panels(weight)
    assert torch.allclose(plain(x, bias, residual, eps), residual + normed @ weight.t() + bias, atol=1e-5, rtol=1e-5)
    gated = matmul_kernels.Panels(weight, gated=True)
    small = x / 8  # no norm: gates of a few units, and some past exp's range (silu -> 0, not NaN)
    small[0, :8] = 40.0
    for got, (a, b) in ((gated(x, bias, None, eps), (normed, bias)), (gated(small, None, None), (small, None))):
        # against float64, within float rounding of the products' terms (silu(g)·up cancels where
        # g or up is near 0, so a fixed tolerance would test the summation order, not the result)
        a, w = a.double(), weight.double()
        gate, up = (a @ w.t() + (0 if b is None else b.double())).chunk(2, dim=-1)
        terms = (a.abs() @ w.abs().t() + (0 if b is None else b.double().abs())).chunk(2, dim=-1)
        scale = F.silu(gate).abs() * terms[1] + terms[0] * up.abs()
        assert got.shape == (rows, 100)
        assert ((got.double() - F.silu(gate) * up).abs() <= 1e-6 * scale + 1e-6).all()


def test_panels_packed_from_row_blocks_equal_the_concatenated_weight():
    """Panels packed straight from row blocks (rows reordered and scaled per block, every input
    feature scaled) compute x @ W.T for W = RowBlocks.tensor(), the blocks concatenated; gated, each
    half of the 100 rows (split inside a block) in whole panels of its own."""
    if not matmul_kernels.c_matmul_ready(torch.empty(1)):
        pytest.skip("the C kernels are not built here (no compiler, or HFLOW_CPU_KERNELS=0)")
    torch.manual_seed(0)
    # b a transposed view (rows not contiguous: packed from a copy the blocks keep)
    a, b, col, x = torch.randn(40, 64), torch.randn(64, 60).t(), torch.rand(64) + 0.5, torch.randn(5, 64)
    order = torch.randperm(40)
    blocks = matmul_kernels.RowBlocks([(a, order, 0.5), (b, None, 2.0)], col)
    weight = blocks.tensor()
    assert torch.equal(weight, torch.cat([a[order] * 0.5, b * 2.0]) * col)
    assert torch.allclose(matmul_kernels.Panels(blocks)(x, None, None), x @ weight.t(), atol=1e-5, rtol=1e-5)
    gate, up = weight[:50], weight[50:]
    assert torch.allclose(matmul_kernels.Panels(blocks, gated=True)(x, None, None),
                          F.silu(x @ gate.t()) * (x @ up.t()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_panels_pick_greedily_what_the_logits_give(rows):
    """A pick through the panels (the logits never written) gives what the greedy pick from the
    written logits gives: the first index of each row's largest (ties planted in one panel and
    across panels; 100 features: a partly filled last panel) and its log-probability. 300 rows:
    two row blocks."""
    if not matmul_kernels.c_matmul_ready(torch.empty(1)):
        pytest.skip("the C kernels are not built here (no compiler, or HFLOW_CPU_KERNELS=0)")
    torch.manual_seed(rows)
    eps = 64 * 1e-6
    x, weight, bias = torch.randn(rows, 64), torch.randn(100, 64), torch.randn(100)
    weight[7] = weight[70] = weight[90] = weight[5] = 4 * torch.randn(64)  # the same logit at 5, 7, 70 and 90 (if bias allows)
    bias[5] = bias[7] = bias[70] = bias[90] = 30.0  # ... and the largest: the first, 5, wins
    panels = matmul_kernels.Panels(weight)
    logits = panels(x, bias, None, eps)
    tokens, logp = panels(x, bias, None, eps, pick=True)
    want = sample_tokens(logits, SamplingParams(greedy=True))
    assert torch.equal(tokens, want[0]) and torch.equal(tokens, logits.argmax(-1))
    assert (tokens == 5).float().mean() > 0.5  # the planted tie decides most rows
    assert torch.allclose(logp, want[1], atol=1e-6, rtol=0)


# A tiny model whose gate|up and lm_head are big enough to be packed from 2 rows
# (2·1024·128 = 2048·128 = PACKED_MIN_SIZE elements); q|k|v, o and down stay small.
SHAPES = {"llama": dict(num_key_value_heads=2),
          "qwen2": dict(family="qwen2", num_key_value_heads=2, qkv_bias=True, tie_word_embeddings=True)}


def _prompts(rows: int, longest: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` left-padded prompts of 4..`longest` tokens, the first `longest` long (so a 64-row
    prefill has 512 rows: PACKED_MIN_ROWS)."""
    g = torch.Generator().manual_seed(rows)
    lens = [longest] + torch.randint(4, longest + 1, (rows - 1,), generator=g).tolist()
    return left_pad([torch.randint(1, 2048, (n,), generator=g).tolist() for n in lens])


@pytest.mark.parametrize("panels", [True, False])
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernels_give_module_tokens(shape, rows, panels, monkeypatch):
    """At the row counts where the kernels change the fused path's tokens equal the modules', log-probs
    within 1e-5 — greedy, and sampled with rows leaving the batch at EOS (fewer rows on the same
    operands). With the C kernels (`panels`, where they build): panels at 1 and 4 rows, and at 16 and
    64 with the library's AVX-512 tile, the prefill on the same panels. Without (torch's ops
    throughout): 1: MKL on row-major copies, an 8-row prefill on views; 4: big weights packed; 16: big
    weights packed, the small ones still row-major; 64: small ones as [out, in] views, the 512-row
    prefill packed throughout."""
    if not panels:
        for module in (fast_decode, matmul_kernels):
            monkeypatch.setattr(module, "c_matmul_ready", lambda w: False)
    torch.manual_seed(0)
    cfg = model_preset("tiny").decoder_config(num_hidden_layers=2, intermediate_size=1024, vocab_size=2048,
                                               **SHAPES[shape])
    model = CausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a dropped term would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    ids, mask = _prompts(rows)
    fused = fast_decode.FusedDecoder(model, rows, ids.shape[1] + 1)
    wqkv, _, wo, _, wgu, *_ = fused.layers[0]
    prefill_rows = rows * ids.shape[1]
    _, _, prefill_wo, _, prefill_wgu, *_ = fused._prefill_layers(prefill_rows)[0]
    if matmul_kernels.matmul_kind(model.lm_head.weight, rows, panels=True) == "panel":
        assert panels and all(isinstance(w, matmul_kernels.Panels) for w in (fused.lm_head, wqkv, wo, wgu))
        # the prefill runs on them where they are its kernel too, or stand in for a row-major copy
        o_proj = model.model.layers[0].self_attn.o_proj.weight
        reused = matmul_kernels.matmul_kind(o_proj, prefill_rows, once=True, panels=True) == "panel" or \
            prefill_rows <= matmul_kernels.ROW_MAJOR_MAX_BATCH
        assert (prefill_wo is wo) == (prefill_wgu is wgu) == reused
    else:
        assert fused.lm_head.is_mkldnn == wgu.is_mkldnn == (rows > 1) and not wqkv.is_mkldnn
        assert wo.is_contiguous() == (rows <= matmul_kernels.ROW_MAJOR_MAX_BATCH)
        assert prefill_wo.is_mkldnn == (prefill_rows >= matmul_kernels.PACKED_MIN_ROWS)
        assert prefill_wgu is wgu  # the decode steps' operand reused
    for params in (SamplingParams(max_new_tokens=6, greedy=True),
                   SamplingParams(max_new_tokens=6, temperature=0.9, top_k=50, eos_token_id=list(range(5, 2048, 5)))):
        fast = GenerationEngine(model).generate(ids, mask, params, torch.Generator().manual_seed(4))
        slow = GenerationEngine(model, fast_decode=False).generate(ids, mask, params,
                                                                   torch.Generator().manual_seed(4))
        assert torch.equal(fast.response, slow.response) and torch.equal(fast.response_mask, slow.response_mask)
        assert torch.allclose(fast.response_logprobs, slow.response_logprobs, atol=1e-5)
