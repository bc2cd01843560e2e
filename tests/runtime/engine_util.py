"""Shared helpers of the engine tests: a tiny decoder (E's model) and a seeded token batch."""

from __future__ import annotations

import torch

from hybridflow.runtime.models.decoder import CausalLM, ScoreModel
from hybridflow.simulator.vocabulary.decoder_config import DecoderConfig

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)


def tiny_model(seed: int = 0, score: bool = False, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = DecoderConfig(**{**TINY, **overrides})
    return (ScoreModel if score else CausalLM)(cfg)


def token_batch(n: int = 8, seq: int = 12, vocab: int = 128, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def nll_loss(outputs, micro):
    """Mean next-token negative log-likelihood over real tokens (position 0 has no prediction)."""
    mask = micro["attention_mask"][:, 1:].float()
    nll = -(outputs["log_probs"][:, 1:] * mask).sum() / mask.sum()
    return nll, {"entropy": float((outputs["entropy"].detach()[:, 1:] * mask).sum() / mask.sum())}


def engine_errors(cases) -> list[str]:
    """The one-line errors FsdpEngine gives for each (ParallelConfig, tiny_model overrides) case that it
    refuses (run inside each rank of a process group)."""
    from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine
    from hybridflow.simulator.errors import HflowError

    messages = []
    for cfg, over in cases:
        try:
            FsdpEngine(tiny_model(**over), cfg)
        except HflowError as e:
            messages.append(str(e))
    return messages
