"""Shared prompts: one forward over a prompt and all of its sampled responses (GRPO's groups).

GRPO, RLOO, DAPO… sample several responses per prompt, so a batch holds each prompt several times,
and a plain forward computes it once per copy. Here the rows of a micro-batch that share a prompt
become ONE packed row: the prompt's real tokens, then each response's real tokens back to back,

    [ p p p p | a a a | b b | c c c c ]  (+ padding to the micro-batch's longest packed row)

with each token at its original position id and a block mask: the prompt attends causally to
itself, each response to the whole prompt and causally to itself, never to another response. A
response token so sees exactly the keys and positions it sees in its own padded row, and its
log-prob is the same to float rounding; the prompt is computed (and back-propagated) once per group,
and the padding between rows is gone. The gradient is the same sum: the prompt's share of it
arrives from every response at once instead of row by row (a different order of fp32 additions).

Only the responses' log-probs are produced (the caller's `score_width` columns): the LM head runs
on the positions that predict them, which for a response's first token is the shared prompt's last.
Rows qualify when each is a left-padded prompt followed by a right-padded response (the RL batch
layout) and the engine qualifies (`simulator/vocabulary/execution.py` shares_prompts: one rule for the runtime and the
simulator); otherwise the engine runs its row packing (packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridflow.runtime.engines.train.packing import bucket_order


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The prompt group of each row [b]: rows with the same real prompt tokens share an id (0..G-1)."""
    real = attention_mask[:, :prompt_width].bool()
    key = torch.where(real, input_ids[:, :prompt_width], -1)  # ids ≥ 0, so -1 also encodes the padding
    return torch.unique(key, dim=0, return_inverse=True)[1]


def _layout_ok(mask: torch.Tensor, prompt_width: int) -> bool:
    """Each row: a non-empty left-padded prompt in columns < prompt_width, then a right-padded response."""
    if prompt_width < 1 or prompt_width >= mask.shape[1]:
        return False
    prompt, response = mask[:, :prompt_width].long(), mask[:, prompt_width:].long()
    return bool(prompt[:, -1].all() and (prompt.diff(dim=1) >= 0).all() and (response.diff(dim=1) <= 0).all())


def micro_batch_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, size: int,
                     prompt_width: int | None) -> list[torch.Tensor] | None:
    """Row indices of each micro-batch of `size` rows (the last may hold fewer). With repeated prompts the
    rows are ordered by prompt group, groups by their total length, so whole groups fall together (a group
    that straddles a cut is shared within each piece); else packing.bucket_order's length buckets. The
    count is always ⌈rows / size⌉, as without sharing: data-parallel ranks with equal shares run the same
    number of micro-batches. None: consecutive rows."""
    order = bucket_order(attention_mask, size)
    if order is not None and prompt_width and _layout_ok(attention_mask, prompt_width):
        group = prompt_groups(input_ids, attention_mask, prompt_width)
        n_groups = int(group.max()) + 1
        if n_groups < group.numel():
            lengths = torch.zeros(n_groups, dtype=torch.long).index_add_(0, group, attention_mask.long().sum(-1))
            rank = torch.empty_like(lengths)
            rank[torch.sort(lengths, stable=True).indices] = torch.arange(n_groups)
            order = torch.sort(rank[group], stable=True).indices
    return None if order is None else list(order.split(size))


@dataclass
class SharedPrompts:
    """A micro-batch packed one row per prompt group (see the module docstring)."""

    input_ids: torch.Tensor  # [G, W]
    position_ids: torch.Tensor  # [G, W]
    attention: torch.Tensor  # [G, 1, W, W] bool, True: the query (row) sees the key (column)
    predictor: torch.Tensor  # [N] flat index into [G·W] of the position whose logits predict each real response token
    targets: torch.Tensor  # [N] the real response tokens
    response_mask: torch.Tensor  # [b, R] bool, N of them true
    real_tokens: int  # the packed rows' real tokens (each prompt once)
    caller_width: int  # P + R, the caller's columns

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N] values of the real response tokens → [b, P+R] in the caller's layout, 0 on the prompt and padding."""
        m = self.response_mask
        out = x.new_zeros(m.shape).masked_scatter(m, x)
        return F.pad(out, (self.caller_width - m.shape[1], 0))


def share_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None,
                  prompt_width: int) -> SharedPrompts | None:
    """Pack a micro-batch one row per prompt group; None when no prompt repeats or the rows are not laid
    out as prompt + response (see the module docstring)."""
    mask = attention_mask.bool()
    b, s = mask.shape
    if not _layout_ok(mask, prompt_width):
        return None
    # groups of consecutive rows with the same prompt (micro_batch_rows puts a group's rows together; a
    # cheaper test than prompt_groups, and a prompt that recurs further down is only computed again)
    key = torch.where(mask[:, :prompt_width], input_ids[:, :prompt_width], -1)
    group = F.pad((key[1:] != key[:-1]).any(-1).long(), (1, 0)).cumsum(0)
    n_groups = int(group[-1]) + 1
    if n_groups == b:
        return None
    if position_ids is None:
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    p_len, r_len = mask[:, :prompt_width].sum(-1), mask[:, prompt_width:].sum(-1)
    # each response's start after its group's prompt: the lengths of the group's earlier responses
    order = torch.sort(group, stable=True).indices
    before = torch.cumsum(r_len[order], 0) - r_len[order]
    starts = torch.searchsorted(group[order], torch.arange(n_groups, device=group.device))
    offset = torch.empty_like(before)
    offset[order] = before - before[starts][group[order]]
    group_len = p_len.new_zeros(n_groups).index_add_(0, group, r_len)
    group_len += p_len.new_zeros(n_groups).scatter_(0, group, p_len)
    width = int(group_len.max())
    # the packed slot of every caller column (valid where the mask is)
    cols = torch.arange(s, device=mask.device)[None]
    slot = torch.where(cols < prompt_width, cols - (prompt_width - p_len[:, None]),
                       p_len[:, None] + offset[:, None] + cols - prompt_width)
    flat = (group[:, None] * width + slot).clamp(0, n_groups * width - 1)
    real = flat[mask]
    ids = input_ids.new_zeros(n_groups * width).index_put_((real,), input_ids[mask])  # a prompt: same values
    pos = position_ids.new_zeros(n_groups * width).index_put_((real,), position_ids[mask])
    rows = torch.arange(b, device=mask.device)[:, None].expand(b, s)
    segment = torch.full((n_groups * width,), -1, dtype=torch.long, device=mask.device)
    segment.index_put_((real,), torch.where(cols < prompt_width, 0, rows + 1)[mask])  # 0: prompt, i+1: row i
    segment = segment.view(n_groups, width)
    q, k = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
    sees = causal & (k >= 0) & ((k == 0) | (k == q))
    sees |= torch.eye(width, dtype=torch.bool, device=mask.device)  # a padding slot sees itself: no empty row
    response = mask[:, prompt_width:]
    predictor = flat[:, prompt_width - 1:s - 1][response]  # a response's first token: from the prompt's last
    return SharedPrompts(ids.view(n_groups, width), pos.view(n_groups, width), sees[:, None], predictor,
                         input_ids[:, prompt_width:][response], response, int((segment >= 0).sum()), s)
