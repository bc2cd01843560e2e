"""The next token of every row in one C call (cpu_kernels.c's greedy_pick / sample_pick): greedy, or
sampled at a temperature with top-k / top-p, from one uniform per row."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.runtime.engines.cpu_decode import cpu_kernels

C_MAX_TOP_K = 1024  # the C sampler keeps the top-k candidates by insertion: for a few, not thousands


def pick_tokens(logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, top_p: float,
                uniforms: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens [B], their log-probs [B]) from fp32 CPU logits [B, V], or None where the C kernels do
    not apply: off CPU, not fp32, not built here, or a top-p cut over the whole vocabulary (a full
    sort). `top_k` 0: off; `uniforms()`: one uniform per row, drawn only when sampling."""
    b, v = logits.shape
    top_k = top_k if 0 < top_k < v else 0
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(-1) != 1 or \
            (not greedy and (top_k > C_MAX_TOP_K or (top_k == 0 and top_p < 1.0))):
        return None
    c = cpu_kernels.kernels()
    if c is None:
        return None
    tokens, logp = torch.empty(b, dtype=torch.long), torch.empty(b)
    if greedy:  # torch's CPU argmax is slow on wide rows
        c.greedy_pick(logits.data_ptr(), logits.stride(0), b, v, tokens.data_ptr(), logp.data_ptr())
        return tokens, logp
    u = uniforms().cpu()
    scratch, slots = torch.empty(max(v, top_k)), torch.empty(max(top_k, 1), dtype=torch.long)
    c.sample_pick(logits.data_ptr(), logits.stride(0), b, v, 1.0 / temperature, top_k, top_p,
                  u.data_ptr(), tokens.data_ptr(), logp.data_ptr(), scratch.data_ptr(), slots.data_ptr())
    return tokens, logp
