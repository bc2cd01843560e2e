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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
