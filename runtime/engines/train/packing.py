"""Padding removal for the training engine's forward passes (verl's dynamic batch size / remove-padding idea).

RL batches are left-padded prompts followed by right-padded responses, so each row's real tokens
are one contiguous run somewhere in the row. Two standard tricks cut the padding without changing
any real token's result:

- length buckets: the rows of a local batch are sorted by real length (stable, so deterministic)
  before they are cut into micro-batches, so each micro-batch holds sequences of similar length;
- repacking: inside a micro-batch every row is shifted left so its real tokens start at column 0,
  and the micro-batch is trimmed to its own longest row. With no left padding the model runs plain
  causal attention (no mask): a real token attends exactly to the real tokens before it, as the
  masked original does, and the right padding only ever follows the real tokens.

Per-token outputs are mapped back to the caller's layout (`unpack`), so losses and callers see the
columns they gave; padding positions come back as 0. Rows whose mask is not one contiguous run
(a general batch) are left as they are.

With a token budget the engine packs sequences instead (the second half of this file: micro-batches by
tokens, `SequencePack`; fsdp/packed.py runs them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.simulator.errors import HflowError


def real_lengths(mask: torch.Tensor) -> torch.Tensor:
    return mask.long().sum(-1)


def bucket_order(mask: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """Row order for micro-batches of `size` rows: by real length, shortest first (None: keep the order,
    when there is no mask or the batch is one micro-batch anyway)."""
    if mask is None or size >= mask.shape[0]:
        return None
    return torch.sort(real_lengths(mask), stable=True).indices


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


@dataclass
class Packed:
    """A micro-batch with each row's real tokens moved to columns 0..len-1, trimmed to the longest."""

    input_ids: torch.Tensor  # [b, W]
    position_ids: torch.Tensor  # [b, W]
    mask: torch.Tensor  # [b, S] the caller's attention mask (bool)
    source: torch.Tensor  # [b, S] packed column of each original column (clamped; valid where mask)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[b, W, ...] packed per-token values → [b, S, ...] in the caller's layout, 0 on padding."""
        index = self.source.view(*self.source.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        keep = self.mask.view(*self.mask.shape, *([1] * (x.dim() - 2)))
        return torch.where(keep, x.gather(1, index), torch.zeros((), dtype=x.dtype, device=x.device))


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor,
         position_ids: torch.Tensor | None) -> Packed | None:
    """Repack a micro-batch (see the module docstring); None when a row's real tokens are not contiguous."""
    mask = attention_mask.bool()
    b, s = mask.shape
    lengths = real_lengths(mask)
    first = mask.long().argmax(-1)  # 0 for an all-padding row (length 0)
    last = s - 1 - mask.flip(-1).long().argmax(-1)
    if bool(((last - first + 1 != lengths) & (lengths > 0)).any()):
        return None
    width = max(int(lengths.max()), 1)
    cols = torch.arange(width, device=mask.device)
    take = (first[:, None] + cols[None]).clamp(max=s - 1)  # beyond a row's end: its trailing padding
    ids = input_ids.gather(1, take)
    pos = position_ids.gather(1, take) if position_ids is not None else cols.expand(b, width)
    source = (torch.arange(s, device=mask.device)[None] - first[:, None]).clamp(0, width - 1)
    return Packed(ids, pos, mask, source)


# ---- sequence packing: several sequences in one row, attention confined to each ---------------------------
#
# The row repacking above still pads every row of a micro-batch to its longest; under a long tail of response
# lengths that is most of the compute. Sequence packing concatenates the real tokens of all the micro-batch's
# rows into ONE row, position ids restarting per sequence, and attention confined to each sequence (the
# varlen attention core, segment_attention.py). Micro-batches are then formed by a token budget (at most so many
# real tokens each) instead of a row count.


def token_budget_bins(lengths: list[int], budget: int, count: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch holding at most `budget` real tokens, by first-fit decreasing (ties by
    row index: deterministic), each micro-batch's rows in ascending order. `count`: at least so many
    micro-batches where there are rows enough (the most any data-parallel rank needs, so that the ranks run the
    same number): the fullest micro-batch of two rows or more is halved until there are.
    A row longer than the budget: HflowError (one line)."""
    longest = max(lengths, default=0)
    if longest > budget:
        raise HflowError(f"micro-batch token budget {budget} is below the longest sequence ({longest} tokens); "
                         f"raise it to at least {longest}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    while len(bins) < count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            break
        b = max(splittable, key=lambda b: (loads[b], -b))
        rows = bins[b]  # largest first, alternating: two halves of about equal tokens
        halves = (rows[0::2], rows[1::2])
        bins[b:b + 1] = halves
        loads[b:b + 1] = [sum(lengths[i] for i in h) for h in halves]
    return [sorted(rows) for rows in bins]


@dataclass
class SequencePack:
    """A micro-batch's real tokens as one row [1, T] (rows back to back in row order) and the way back."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at each sequence (the caller's position ids where given)
    cu_seqlens: list[int]  # sequence boundaries: sequence j is columns cu[j] .. cu[j+1]-1
    caller_index: torch.Tensor  # [T] flat index into the caller's [b·S] of each packed token
    predictor: torch.Tensor  # [N] packed positions whose next token belongs to the same sequence
    shape: tuple[int, int]  # the caller's (b, S)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]

    def scored(self, score_width: int | None) -> torch.Tensor:
        """The predictor positions whose target lies in the caller's last `score_width` columns (all: None)."""
        if not score_width:
            return self.predictor
        column = self.caller_index[self.predictor + 1] % self.shape[1]
        return self.predictor[column >= self.shape[1] - score_width]

    def unpack_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[T] per-token values (value of packed token t) → [b, S] in the caller's layout, 0 on padding."""
        return x.new_zeros(self.shape[0] * self.shape[1]).index_put_((self.caller_index,), x).view(self.shape)

    def unpack_predictions(self, x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """[N] values computed at predictor positions `at` (each the prediction of the next token) → [b, S]
        aligned with input_ids as token_log_probs aligns them: at the predicted token's column, 0 elsewhere."""
        out = x.new_zeros(self.shape[0] * self.shape[1])
        return out.index_put_((self.caller_index[at + 1],), x).view(self.shape)


def pack_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor | None) -> SequencePack | None:
    """Pack a micro-batch as one row (see above); None when a row's real tokens are not one contiguous run
    (the engine then runs the micro-batch as it is) or no row has a real token."""
    mask = attention_mask.bool()
    b, s = mask.shape
    lengths = real_lengths(mask)
    first = mask.long().argmax(-1)
    last = s - 1 - mask.flip(-1).long().argmax(-1)
    if bool(((last - first + 1 != lengths) & (lengths > 0)).any()) or int(lengths.sum()) == 0:
        return None
    flat = mask.flatten()
    caller_index = flat.nonzero().squeeze(-1)  # row-major: the rows' real tokens back to back
    ids = input_ids.flatten()[caller_index]
    cu = [0, *torch.cumsum(lengths[lengths > 0], 0).tolist()]
    starts = torch.tensor(cu[:-1], device=mask.device).repeat_interleave(lengths[lengths > 0])
    if position_ids is not None:
        pos = position_ids.flatten()[caller_index]
    else:
        pos = torch.arange(len(ids), device=mask.device) - starts
    last_of_sequence = torch.zeros(len(ids), dtype=torch.bool, device=mask.device)
    last_of_sequence[torch.tensor(cu[1:], device=mask.device) - 1] = True
    predictor = (~last_of_sequence).nonzero().squeeze(-1)
    return SequencePack(ids[None], pos[None], cu, caller_index, predictor, (b, s))
