"""Sequence packing in the FSDP engine (`micro_batch_tokens`): micro-batches by a token budget, each run as
one row of sequences with attention confined to each (packing.py `SequencePack`, segment_attention.py).

The micro-batches of a local batch are its rows binned by real tokens (packing.token_budget_bins), as many
on every data-parallel rank as the rank that needs the most (one all-reduce), so the ranks run matched
steps; the loss still sees each micro-batch's rows in the caller's layout, so every loss and its weighting
(engine.py) are those of the padded pass. The LM head runs only on the positions whose next token is scored.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.runtime.engines.train.fsdp.ulysses import whole_sequence_attention
from hybridflow.runtime.engines.train.logits import entropy_of, picked_log_probs
from hybridflow.runtime.engines.train.packing import SequencePack, real_lengths, token_budget_bins
from hybridflow.runtime.engines.train.segment_attention import SegmentAttention, install_segment_attention
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def packing_core(model: nn.Module, parallel: ParallelConfig, micro_batch_tokens: int | None) -> SegmentAttention | None:
    """The attention core packed forwards confine to each sequence (None without a token budget): installed on
    `model` at sp = 1; under sp > 1 the core Ulysses runs between its exchanges (give it to apply_ulysses)."""
    if micro_batch_tokens is None:
        return None
    if micro_batch_tokens < 1:
        raise HflowError(f"micro-batch token budget must be a positive number of tokens, got {micro_batch_tokens}")
    if parallel.pp > 1:
        raise HflowError(f"{parallel}: sequence packing (a micro-batch token budget) runs with pp=1 on this "
                         "runtime; drop the token budget or use tp·dp·sp")
    if parallel.sp > 1:
        return SegmentAttention(whole_sequence_attention)
    return install_segment_attention(model)


def token_micro_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, budget: int,
                     dp_group) -> list[torch.Tensor]:
    """Each micro-batch's rows: at most `budget` real tokens each, as many micro-batches as the data-parallel
    rank that needs the most (where this rank has rows enough)."""
    rows, columns = input_ids.shape
    lengths = real_lengths(attention_mask).tolist() if attention_mask is not None else [columns] * rows
    count = len(token_budget_bins(lengths, budget))
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        most = torch.tensor([count])
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=dp_group)
        count = int(most)
    return [torch.tensor(b, dtype=torch.long) for b in token_budget_bins(lengths, budget, count)]


def packed_forward(model: nn.Module, packed: SequencePack, segments: SegmentAttention, *, lm: bool, tempered,
                   entropy: bool, score_width: int | None, clock=None) -> dict[str, torch.Tensor]:
    """FsdpEngine.forward's outputs for a packed micro-batch (sp = 1), in the caller's layout."""
    if clock is not None and clock.enabled:
        clock.count_pass(1, packed.tokens, packed.tokens)
    with segments.segments(packed.cu_seqlens):
        if not lm:
            return {"values": packed.unpack_tokens(model(packed.input_ids, None, packed.position_ids)[0].float())}
        at = packed.scored(score_width)
        logits = tempered(model(packed.input_ids, None, packed.position_ids, logits_at=at))
    res = {"log_probs": packed.unpack_predictions(picked_log_probs(logits, packed.input_ids[0, at + 1]), at)}
    if entropy:
        res["entropy"] = packed.unpack_predictions(entropy_of(logits), at)
    return res
