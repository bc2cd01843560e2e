"""Token statistics from an LM's logits, as both training engines compute them: the log-prob of each
chosen token, the entropy of each predictive distribution, and the first position whose logits a
pass that reads only the responses needs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.runtime.engines.train.packing import Packed


def picked_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] for logits [..., V] and targets [...] (fp32): the chosen logit minus the
    logsumexp, so no [..., V] log-softmax is kept for the backward (it recomputes the softmax from the
    logits it already holds)."""
    logits = logits.float()
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension (fp32)."""
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (F.softmax(logits, -1) * logits).sum(-1)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """log p(input_ids[:, i] | < i) from logits [B, S - start, V] of positions start…S-1; [B, S] with
    positions ≤ start = 0 (fp32)."""
    return F.pad(picked_log_probs(logits[:, :-1], input_ids[:, start + 1:]), (start + 1, 0))


def token_entropy(logits: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Entropy of each predictive distribution, aligned like token_log_probs: [B, S] (fp32)."""
    return F.pad(entropy_of(logits[:, :-1]), (start + 1, 0))


def first_scored_logit(width: int, score_width: int | None, packed: Packed | None) -> int:
    """The first position whose logits a forward over `width` columns needs when only the caller's last
    `score_width` columns are read (each column's log-prob comes from the logits one position before)."""
    if not score_width:
        return 0
    if packed is None:
        return max(width - score_width - 1, 0)
    caller = packed.source.shape[1]
    return max(int(packed.source[:, max(caller - score_width, 0)].min()) - 1, 0)
