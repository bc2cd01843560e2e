"""Mixtral's sparse mixture of SwiGLU experts: the feed-forward block of a MoE decoder layer
(models/decoder.py), under Hugging Face's names (`block_sparse_moe.gate`, `.experts.N.w1/w2/w3`).
Like the decoder it knows nothing of parallelism: the megatron backend splits the experts over ep."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig


class Expert(nn.Module):
    """One SwiGLU expert under Mixtral's names: w1 the gate, w3 the up and w2 the down projection."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Mixtral's sparse feed-forward: the router `gate` scores every expert per token; each token goes
    to its top-k experts, their outputs summed with the top-k softmax probabilities renormalised to 1
    (routing in fp32, as transformers does it)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(tokens).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            # Every expert runs, on no tokens if none chose it, so each gets a gradient (0) every step.
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view_as(x)
