"""Ulysses sequence parallelism (DeepSpeed-Ulysses) for the FSDP engine: each sequence split over `sp`
consecutive data-parallel ranks (ParallelConfig.sp; docs/cost-model.md prices it).

The ranks of an sp group hold the same rows (the dispatch gives them the same dp/sp shard,
controller/protocols.py) and each runs the model on its own slice of the columns: every op but attention is
per token. Attention swaps its core (`Attention.core`, models/decoder.py) for `UlyssesAttention`: q, k and v
go from sequence-sharded [B, heads, S/sp, d] to head-sharded [B, heads/sp, S, d] by one all-to-all each
(kv heads repeated first where a rank holds fewer of them than sp), plain causal attention runs over the
whole sequence for the local heads, and one all-to-all brings the output back. Both exchanges are autograd
functions whose backward is the opposite exchange.

`SequenceSplit.forward` runs a micro-batch: the rows packed (packing.py: real tokens from column 0, so no
attention mask is needed), padded to a multiple of sp, this rank's slice given its global RoPE positions; the
per-token results (log-probs, entropy, values — never the logits) are gathered along the sequence by
`gather_sequence`, whose backward keeps this rank's slice of the gradient: every rank of the group computes
the same loss from the same gathered tensor, so the slices' contributions add up to the whole gradient over
the group. FSDP then averages over all dp ranks, sp of which computed each sequence's gradient between them,
so the engine scales its backward by sp (`grad_scale`): the step is exactly that of sp = 1.

All-to-all runs on gloo (CPU) as on NCCL: torch.distributed.all_to_all_single.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridflow.runtime.engines.train.logits import entropy_of, first_scored_logit, picked_log_probs
from hybridflow.runtime.engines.train.packing import SequencePack, pack
from hybridflow.runtime.engines.train.segment_attention import SegmentAttention
from hybridflow.runtime.models.decoder import attention_bias_mask, sdpa_attention
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

# ---- the sequence-parallel groups -------------------------------------------------------------------


def sp_group_ranks(cfg: ParallelConfig) -> list[list[int]]:
    """Every sp group's global ranks: dp ranks j·sp … j·sp+sp-1 (stride tp) of each pp stage and tp rank, in
    the rank order (pp, dp, tp) with tp fastest."""
    groups = []
    for pp in range(cfg.pp):
        for j in range(cfg.dp // cfg.sp):
            for tp in range(cfg.tp):
                groups.append([pp * cfg.dp * cfg.tp + (j * cfg.sp + k) * cfg.tp + tp for k in range(cfg.sp)])
    return groups


def new_sp_group(cfg: ParallelConfig) -> dist.ProcessGroup:
    """This rank's sp process group (a collective: every rank of the world creates every group)."""
    mine, _ = dist.new_subgroups_by_enumeration(sp_group_ranks(cfg))
    return mine


def check_sp(model: nn.Module, cfg: ParallelConfig) -> None:
    """One-line HflowError for a model or layout Ulysses cannot split (whole heads per rank)."""
    c = model.config
    heads, kv, split = c.num_attention_heads, c.num_key_value_heads, cfg.sp * cfg.tp
    if heads % split or (kv % split and split % kv):
        raise HflowError(f"sp·tp={split} must divide heads={heads} (and divide or be a multiple of "
                         f"kv_heads={kv}): Ulysses gives each rank whole heads; pick a smaller sp")
    if cfg.pp > 1:
        raise HflowError(f"{cfg}: sequence parallelism runs with pp=1 on this runtime; use sp·dp·tp")


def apply_ulysses(model: nn.Module, group: dist.ProcessGroup, local=None) -> nn.Module:
    """Swap every decoder layer's attention core for the Ulysses one over `group` (in place); `local`: the core
    between the exchanges (UlyssesAttention)."""
    core = UlyssesAttention(group, local or whole_sequence_attention)
    for layer in model.model.decoder_layers():
        layer.self_attn.core = core
    return model


# ---- the exchanges --------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk j of `x` along `scatter_dim` to rank j; the chunks received, in rank order, along `gather_dim`."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Autograd all-to-all: split `scatter_dim` over the group, gather `gather_dim` (backward: the reverse)."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank of the group holds the same gradient of the same loss: this rank's slice is its share.
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The group's slices of `x` concatenated along `dim` in rank order (backward: this rank's slice)."""
    return _GatherSequence.apply(x, group, dim)


# ---- attention ----------------------------------------------------------------------------------------


def whole_sequence_attention(q, k, v, mask, window=None):
    """Causal attention over the whole (gathered) sequence, with the layer's sliding window if any; the
    decoder's mask, built for this rank's slice, does not apply."""
    s = q.shape[2]
    full = None
    if window is not None and s > window:
        full = attention_bias_mask(torch.ones(1, s, dtype=torch.bool, device=q.device), s, 0, window)
    return sdpa_attention(q, k, v, full)


class UlyssesAttention:
    """The attention core of `Attention` under sequence parallelism (see the module docstring). It ignores the
    decoder's mask: the rows it sees are packed, so attention is causal (with the layer's sliding window over
    the whole sequence, if any). `local` is the core run on the whole sequence between the exchanges (the
    per-sequence one of segment_attention.py under sequence packing)."""

    def __init__(self, group: dist.ProcessGroup, local=whole_sequence_attention):
        self.group, self.size = group, dist.get_world_size(group)
        self.local = local

    def __call__(self, q, k, v, mask, window=None):
        sp = self.size
        if k.shape[1] % sp:  # fewer kv heads than ranks: each rank takes a copy of the one its q heads read
            k, v = (t.repeat_interleave(sp // t.shape[1], dim=1) for t in (k, v))
        q, k, v = (all_to_all(t, self.group, 1, 2) for t in (q, k, v))
        return all_to_all(self.local(q, k, v, None, window), self.group, 2, 1)


# ---- a micro-batch's forward ------------------------------------------------------------------------------


class SequenceSplit:
    """This rank's place in its sp group and the forward of a micro-batch split along the sequence."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    @property
    def grad_scale(self) -> int:
        """The factor the engine's backward takes: FSDP averages over dp ranks, sp of which share a sequence."""
        return self.size

    def forward(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None, *,
                lm: bool, tempered, entropy: bool, score_width: int | None, clock=None) -> dict[str, torch.Tensor]:
        """The FsdpEngine.forward outputs of one micro-batch, in the caller's layout, from this rank's slice."""
        packed = pack(ids, mask, pos) if mask is not None else None
        if mask is not None and packed is None:
            raise HflowError(f"sp={self.size}: rows whose real tokens are not one contiguous run cannot be split "
                             "over a sequence-parallel group; train with sp 1")
        if packed is not None:
            ids, pos = packed.input_ids, packed.position_ids
        b, width = ids.shape
        if pos is None:
            pos = torch.arange(width, device=ids.device).expand(b, width)
        n = -(-width // self.size)  # columns per rank
        pad = n * self.size - width  # trailing columns past every real token: causal attention never reads them
        ids = F.pad(ids, (0, pad))
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
        lo = self.rank * n
        if clock is not None and clock.enabled:
            real = packed.mask.sum(-1) if packed is not None else torch.full((b,), width, device=ids.device)
            clock.count_pass(b, n, float((real - lo).clamp(0, n).sum()))
        out = model(ids[:, lo:lo + n].contiguous(), None, pos[:, lo:lo + n].contiguous())
        unpack = packed.unpack if packed is not None else (lambda x: x)
        if not lm:
            return {"values": unpack(gather_sequence(out.float(), self.group)[:, :width])}
        scaled = tempered(out)
        targets = F.pad(ids, (0, 1))[:, lo + 1:lo + n + 1]  # position p predicts the token at p + 1
        # Aligned as token_log_probs: column i holds the prediction of token i (from column i - 1), column 0 none;
        # with `score_width`, columns up to the first scored logit hold 0, as the sp = 1 pass leaves them.
        start = first_scored_logit(width, score_width, packed)
        keep = torch.arange(width, device=ids.device) > start

        def aligned(per_position: torch.Tensor) -> torch.Tensor:
            whole = F.pad(gather_sequence(per_position, self.group)[:, :width - 1], (1, 0))
            return unpack(torch.where(keep, whole, torch.zeros((), dtype=whole.dtype, device=whole.device)))

        res = {"log_probs": aligned(picked_log_probs(scaled, targets))}
        if entropy:
            res["entropy"] = aligned(entropy_of(scaled))
        return res

    def forward_packed(self, model: nn.Module, packed: SequencePack, segments: SegmentAttention, *, lm: bool,
                       tempered, entropy: bool, clock=None) -> dict[str, torch.Tensor]:
        """`forward` of a micro-batch packed as one row of sequences (packing.py `SequencePack`): the row padded
        to a multiple of sp (the padding a sequence of its own, never attended to by a real token), this rank's
        slice run with attention confined to each sequence (`segments`, the core between the exchanges)."""
        ids, pos = packed.input_ids, packed.position_ids
        width = ids.shape[1]
        n = -(-width // self.size)
        pad = n * self.size - width
        ids = F.pad(ids, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, device=pos.device)[None]], dim=1)
        cu = packed.cu_seqlens + ([width + pad] if pad else [])
        lo = self.rank * n
        if clock is not None and clock.enabled:
            clock.count_pass(1, n, float(max(0, min(n, width - lo))))
        with segments.segments(cu):
            out = model(ids[:, lo:lo + n].contiguous(), None, pos[:, lo:lo + n].contiguous())
        if not lm:
            return {"values": packed.unpack_tokens(gather_sequence(out.float(), self.group)[0, :width])}
        scaled = tempered(out)
        targets = F.pad(ids, (0, 1))[:, lo + 1:lo + n + 1]  # position p predicts the token at p + 1
        at = packed.predictor

        def aligned(per_position: torch.Tensor) -> torch.Tensor:
            return packed.unpack_predictions(gather_sequence(per_position, self.group)[0, at], at)

        res = {"log_probs": aligned(picked_log_probs(scaled, targets))}
        if entropy:
            res["entropy"] = aligned(entropy_of(scaled))
        return res
