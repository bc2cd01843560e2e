"""A plain (unsharded, hook-free) `CausalLM` as a few fused functions over its weights.

Generation of a small model is bound by per-op overhead more than by its matmuls: each dispatched
op costs microseconds whatever its size. So `FusedDecoder` runs the same math as `decoder.py` with
fewer ops, on weights rearranged ONCE per `generate()` call from the live parameters (so the
actor's weights as they are now; one pass over them, into memory the engine keeps from call to
call — kept_memory.py):

- one q|k|v matmul and one gate|up matmul per layer (weights concatenated; for the C kernels'
  panels, packed straight from the separate projections: matmul_kernels.RowBlocks);
- each RMSNorm's weight (and its sqrt(hidden)) folded into the matmul that reads it, so a norm is
  x / hypot(‖x‖, sqrt(hidden·eps)): three ops; attention's 1/sqrt(head_dim) folded into q (into
  q_norm's weight where the family normalises each q and k head: Qwen3);
- biases (q/k/v, o, MLP) added in the same matmuls;
- RoPE as one complex multiply over q and k together: their weight rows are permuted so that the
  pairs HF rotates (j, j + head_dim/2) sit side by side. q and k get the same permutation, so q·k
  is unchanged (v is not permuted); the rotations of every position of the run are computed once;
- decode attention as two batched matmuls over (batch, kv head) rows — the heads that share a kv
  head are the rows of one query block (grouped-query without copying the cache), cheaper than
  SDPA with a mask for one query; prefill uses SDPA, on the prompts' real tokens only (padding's
  rows skip the matmuls; with the C kernels the prefill's attention too, so no activation is ever
  copied into a padded layout);
- on CPU in fp32 with one torch thread (the rollout workers' setting), the decode step's and the
  prefill's attention (RoPE, cache write and the attention itself over a paged cache), the norms and
  SiLU·up in cpu_kernels.c, one call each instead of several ops — and with the panel matmuls
  (below) no call at all: each norm inside the matmul that reads it, SiLU·up inside gate|up's;
- the residual add inside the o_proj / down_proj matmul; no module calls;
- each matmul's kernel chosen per weight from its rows (matmul_kernels.py, `matmul_kind`): on CPU
  in fp32 with one thread, cpu_kernels.c's panel matmul (the weight packed in panels of output
  features: a small batch's step streams every weight once, at about the memory's speed; with
  AVX-512 at every row count, else up to PANEL_MAX_ROWS rows); otherwise big weights (and every
  weight in a long prefill) prepacked for oneDNN's linear, the others through MKL, stored
  [in, out] row-major at up to 16 rows. The decode steps' choice is made once per call for its
  batch; the prefill reuses their operands where it can.

Prefill and decode both go through here, so the KV cache (permuted k layout; paged for the C
kernels) is written by this path only. In fp32 the logits equal the module path to float
rounding (tests: 1e-5, same tokens), through the C kernels or torch's ops.

Anything else — a family the registry does not mark `fused_decode`, a sliding window that the run
reaches, a tensor-parallel model (DTensor weights), an FSDP-wrapped one, a model with hooks, a
subclass — goes through the modules, which is always correct; `supports` decides.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridflow.runtime.engines.cpu_decode import cpu_kernels
from hybridflow.runtime.engines.cpu_decode.fused_weights import GATE_UP, fused_weights
from hybridflow.runtime.engines.cpu_decode.kept_memory import KeptMemory
from hybridflow.runtime.engines.cpu_decode.layer_loop import LayerLoop
from hybridflow.runtime.engines.cpu_decode.matmul_kernels import (
    Panels,
    c_matmul_ready,
    linear,
    matmul_kind,
    matmul_layout,
    matmul_operand,
)
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.simulator.vocabulary.families import family


def supports(model: torch.nn.Module, max_len: int) -> bool:
    """True for an exact `CausalLM` of a family the fused path runs, with plain-tensor weights, no
    hooks on any module, and no sliding window that a run of `max_len` positions reaches (the fused
    path attends to every earlier key)."""
    if type(model) is not CausalLM:
        return False
    cfg = model.config
    if not family(cfg.family).fused_decode or (cfg.sliding_window is not None and max_len > cfg.sliding_window):
        return False
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return False  # DTensor (tensor-parallel or FSDP) weights: the modules' hooks must run
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class Picked(NamedTuple):
    """Each row's next token [B] and its log-probability [B], picked greedily as the logits were
    made (`FusedDecoder`'s `greedy`)."""

    tokens: torch.Tensor
    logp: torch.Tensor


class FusedDecoder:
    """The fused weights of one model and a KV cache for one `generate()` call."""

    def __init__(self, model: CausalLM, batch: int, max_len: int, c_kernels: bool = True,
                 memory: KeptMemory | None = None, greedy: bool = False):
        """`c_kernels`: use the C kernels where they apply (False: torch's ops everywhere); `memory`:
        where their cache and packed weights go (None: allocated for this call); `greedy`: the caller
        picks greedily — where the lm_head is panels, prefill and decode return that pick (`Picked`)
        instead of logits, the logits never written."""
        self.greedy = greedy
        body, cfg = model.model, model.config
        d = cfg.dim_head
        self.head_dim, self.heads, self.kv_heads = d, cfg.num_attention_heads, cfg.num_key_value_heads
        # rsqrt(sum(x²) + n·eps) · sqrt(n) = rsqrt(mean(x²) + eps): the sqrt(n) is in the weights.
        self.norm_eps = cfg.hidden_size * cfg.rms_norm_eps
        self.embed, self.inv_freq = body.embed_tokens.weight, body.inv_freq
        # The C kernels where they run (fp32 on CPU, one torch thread: with more, torch's ops spread
        # over them and the single-threaded kernels would not): the panel matmuls (`matmul_kind`
        # says at which rows), and the attention, norms and SiLU·up where head_dim is whole pages.
        self.c_ready = c_kernels and c_matmul_ready(self.embed)
        if memory is not None:
            memory.restart()
        empty = torch.empty if memory is None else memory.empty  # for the packed weights
        lm_head, self._weights, self.qk_norms = fused_weights(model)
        self.lm_head = matmul_layout(lm_head, batch, self.c_ready, empty=empty)
        self.qk_eps = cfg.rms_norm_eps
        # The decode steps' operands, laid out for `batch` rows (fewer once rows finish: same operands).
        self.layout_rows = batch
        self.layers = [tuple(t if i % 2 else matmul_layout(t, batch, self.c_ready, gated=i == GATE_UP, empty=empty)
                             for i, t in enumerate(weights)) for weights in self._weights]
        dtype, device = self.embed.dtype, self.embed.device
        self.c = cpu_kernels.kernels() if self.c_ready and d % cpu_kernels.CHUNK == 0 else None
        # The cache per layer. For torch's ops keys [B, Hkv, d, T] (transposed: a step's scores are one
        # batched matmul over (row, kv head) blocks, the heads sharing a kv head being one query
        # block) and values [B, Hkv, T, d]; for cpu_kernels.c the same in pages of CHUNK slots,
        # [pages, B, Hkv, d, CHUNK] and [pages, B, Hkv, CHUNK, d] (why: decode_attention's comment).
        if self.c is None:
            self.keys = [torch.empty(batch, self.kv_heads, d, max_len, dtype=dtype, device=device) for _ in self.layers]
            self.values = [torch.empty(batch, self.kv_heads, max_len, d, dtype=dtype, device=device) for _ in self.layers]
        else:
            pages, chunk = cpu_kernels.pages(max_len), cpu_kernels.CHUNK
            size = pages * batch * self.kv_heads * d * chunk
            flat = (torch.empty if memory is None else memory.cache)(2 * len(self.layers) * size)
            flat = flat.view(2, len(self.layers), size)
            self.keys = [t.view(pages, batch, self.kv_heads, d, chunk) for t in flat[0]]
            self.values = [t.view(pages, batch, self.kv_heads, chunk, d) for t in flat[1]]
            self._scratch = torch.empty(batch * self.heads * (d + 2))
        # A decode step in one C call where every layer is panels and the C attention.
        self._loop = None
        if self.c is not None and LayerLoop.applies(self.layers, self.qk_norms):
            self._loop = LayerLoop(self.layers, self.keys, self.values, batch, self.heads, self.kv_heads, d, self.norm_eps)
        self.norm_root_eps = torch.tensor(self.norm_eps, dtype=torch.float32, device=device).sqrt()
        self.length = 0  # cache slots filled, padding included (torch's cache, or the C one after a padded prefill)
        # The C kernels' cache: each row's next slot, and whether rows hold their own tokens from slot
        # 0 (prefill_attention's layout) rather than the prompts' padding too.
        self.slots: torch.Tensor | None = None
        self.compact = False

    def _store_prompt(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt's keys and values [B, Hkv, S, d] into cache slots 0..S-1 (the C kernels'
        prefill_attention writes them itself)."""
        s = k.shape[2]
        if self.c is None:
            self.keys[layer].transpose(2, 3)[:, :, :s] = k
            self.values[layer][:, :, :s] = v
            return
        pages = cpu_kernels.pages(s)  # whole pages: the slots past S are rewritten before they are read
        k, v = (F.pad(t, (0, 0, 0, pages * cpu_kernels.CHUNK - s)).unflatten(2, (pages, -1)) for t in (k, v))
        self.keys[layer][:pages] = k.permute(2, 0, 1, 4, 3)
        self.values[layer][:pages] = v.permute(2, 0, 1, 3, 4)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (indices into the current batch) in the KV cache: finished
        sequences leave the batch, so later steps compute (and read the cache of) live rows only.
        Copies the filled slots of the kept rows once — in the compact cache (each row's tokens from slot 0)
        each row's own, not the prompts' padded width: a row continued from a long prefix costs its own
        slots, not every row's."""
        if self.c is None:  # slots: the keys' last dim, the values' third
            n = self.length
            for i, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
                self.keys[i] = keys.new_empty((len(rows), *keys.shape[1:]))
                self.keys[i][..., :n] = keys[rows, ..., :n]
                self.values[i] = values.new_empty((len(rows), *values.shape[1:]))
                self.values[i][:, :, :n] = values[rows, :, :n]
        else:  # pages first, then rows
            need = (self.slots[rows] if self.compact else torch.full((len(rows),), self.length)).tolist()
            bands = self._page_bands(need)
            for cache in (self.keys, self.values):
                for i, old in enumerate(cache):
                    cache[i] = new = old.new_empty((old.shape[0], len(rows), *old.shape[2:]))
                    for lo, hi, kept in bands:  # pages lo..hi-1 of the kept rows that fill them
                        if kept is None:  # every kept row: gathered straight into place
                            torch.index_select(old[lo:hi], 1, rows, out=new[lo:hi])
                        else:
                            new[lo:hi].index_copy_(1, kept, old[lo:hi].index_select(1, rows[kept]))
        if self.slots is not None:
            self.slots = self.slots[rows]
        if self._loop is not None:
            self._loop.retarget(self.keys, self.values)

    @staticmethod
    def _page_bands(slots: list[int]) -> list[tuple[int, int, torch.Tensor | None]]:
        """(first page, end page, the kept rows (new indices) that fill them, None: all) covering each kept
        row's filled pages once: rows grouped by how many pages they fill, from the fewest."""
        filled = [cpu_kernels.pages(n) for n in slots]
        bands, lo = [], 0
        for hi in sorted(set(filled)):
            if hi > lo:
                kept = None if lo == 0 else torch.tensor([j for j, f in enumerate(filled) if f >= hi])
                bands.append((lo, hi, kept))
                lo = hi
        return bands

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of integer positions [..., S] as unit complex numbers [..., S, 1, head_dim/2]
        (angles and cos/sin in fp32, as HF computes them); the 1 broadcasts over heads."""
        angles = positions[..., None].float() * self.inv_freq.float()
        return torch.polar(torch.ones_like(angles), angles).unsqueeze(-2)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.c is not None and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty(x.shape)
            self.c.rms_norm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], self.norm_eps, out.data_ptr())
            return out
        # x / sqrt(sum(x²) + n·eps) in three ops: hypot(‖x‖, sqrt(n·eps)) is that denominator.
        xf = x.float()
        out = xf / torch.hypot(torch.linalg.vector_norm(xf, 2, -1, True), self.norm_root_eps)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of gu [N, 2·I] = gate | up."""
        if self.c is not None:
            out = torch.empty(gu.shape[0], gu.shape[1] // 2)
            self.c.silu_mul(gu.data_ptr(), gu.stride(0), gu.shape[0], out.shape[1], out.data_ptr())
            return out
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def _normed(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) @ W.T + bias (the norm's weight folded into W): inside the panel kernel where w
        is panels (one call, no normalised copy), else the norm first."""
        if isinstance(w, Panels):
            return w(x, bias, None, self.norm_eps)
        return linear(self._norm(x), w, bias)

    def _head(self, x: torch.Tensor) -> torch.Tensor | Picked:
        """Logits [B, V] of the final hidden states x (the final norm folded into the lm_head), or
        the greedy pick from them where the caller asked for it and the lm_head is panels."""
        if self.greedy and isinstance(self.lm_head, Panels):
            return Picked(*self.lm_head(x, None, None, self.norm_eps, pick=True))
        return self._normed(x, self.lm_head)

    def _mlp(self, x, wo, bo, attn, wgu, bgu, wd, bd) -> torch.Tensor:
        """Residual + o_proj(attn), then residual + SwiGLU MLP, on rows [N, hidden]."""
        x = linear(attn, wo, bo, x)
        if isinstance(wgu, Panels):  # gate|up panels: norm, matmul and silu(gate)·up in one call
            return linear(wgu(x, bgu, None, self.norm_eps), wd, bd, x)
        return linear(self._silu_mul(self._normed(x, wgu, bgu)), wd, bd, x)

    def _qk(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        """The q and k heads of qkv [..., H + 2·Hkv, d]: [..., H + Hkv, d], each head RMS-normalised
        over d (in fp32, scaled in the input dtype, as the module's RMSNorm) where the family does it."""
        qk = qkv[..., :self.heads + self.kv_heads, :]
        weight = self.qk_norms[layer]
        if weight is None:
            return qk
        x = qk.float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.qk_eps)).to(qk.dtype)

    def _rope(self, qk: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
        """q and k heads qk [..., H + Hkv, d] rotated (one complex multiply)."""
        if qk.dtype != torch.float32:  # no bf16 complex type: rotate in fp32 (as HF does), cast back
            return self._rope(qk.float(), rotations).to(qk.dtype)
        return torch.view_as_real(torch.view_as_complex(qk.unflatten(-1, (-1, 2))) * rotations).flatten(-2)

    def prefill(self, tokens: torch.Tensor, rotations: torch.Tensor, mask: torch.Tensor | None,
                real: torch.Tensor | None = None) -> torch.Tensor | Picked:
        """The prompt tokens [B, S] at positions with `rotations` [B, S, 1, head_dim/2]; additive mask
        [B, 1, S, S] or None (causal) -> logits [B, V] of the last position (or their `Picked`).
        Fills cache slots 0..S-1.
        `real`: the indices of the prompts' real (not padding) tokens in the flattened [B·S], in
        order, each row's real tokens its last ones (left padding); only their rows go through the
        matmuls (padding's rows are zero for the attention, which the mask hides), and with the C
        kernels through the attention too (the mask unused); None: every position is real."""
        b, s = tokens.shape
        d, h, hkv = self.head_dim, self.heads, self.kv_heads
        flat = tokens.reshape(-1)
        x = F.embedding(flat if real is None else flat[real], self.embed)  # [N, hidden], N real tokens
        if self.c is not None and (real is not None or mask is None):  # else the mask may hide any key
            return self._prefill_c(x, rotations, real, b, s)
        for i, (wqkv, bqkv, *rest) in enumerate(self._prefill_layers(x.shape[0])):
            qkv = self._normed(x, wqkv, bqkv)
            if real is not None:
                qkv = qkv.new_zeros(b * s, qkv.shape[1]).index_copy_(0, real, qkv)
            qkv = qkv.view(b, s, h + 2 * hkv, d)
            qk = self._rope(self._qk(qkv, i), rotations).transpose(1, 2)  # [B, H + Hkv, S, d]
            k, v = qk[:, h:], qkv[:, :, h + hkv:].transpose(1, 2)
            self._store_prompt(i, k, v)
            # The q scale is folded into the q weights, hence scale=1.
            attn = F.scaled_dot_product_attention(qk[:, :h], k, v, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=h != hkv, scale=1.0).transpose(1, 2).reshape(b * s, h * d)
            x = self._mlp(x, *rest[:2], attn if real is None else attn[real], *rest[2:])
        self.length = s
        self.slots = torch.full((b,), s)  # the padding in the cache: every row's next slot is s
        # Left padding: each prompt's last token is the last of its row's real ones.
        last = x.view(b, s, -1)[:, -1] if real is None else x[torch.bincount(real // s, minlength=b).cumsum(0) - 1]
        return self._head(last)

    def _prefill_c(self, x: torch.Tensor, rotations: torch.Tensor, real: torch.Tensor | None, b: int,
                   s: int) -> torch.Tensor:
        """`prefill` with the C kernels' prefill_attention, on the real tokens' rows x [N, hidden]
        alone from the first matmul to the last (no padded copy of any activation), into a cache
        that holds each row's tokens from slot 0 (so decode steps read no padding and need no mask).
        The prompts are left-padded (generate() checks it): each row's real tokens are its last ones."""
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        counts = torch.full((b,), s) if real is None else torch.bincount(real // s, minlength=b)
        first = F.pad(counts.cumsum(0), (1, 0))  # sequence i's rows: first[i] .. first[i+1]-1
        rot = torch.view_as_real(rotations.reshape(b * s, d // 2))  # [B·S, d/2, 2]: cos, sin
        rot = (rot if real is None else rot[real]).contiguous()
        for i, (wqkv, bqkv, *rest) in enumerate(self._prefill_layers(x.shape[0])):
            qkv = self._normed(x, wqkv, bqkv)
            if self.qk_norms[i] is not None:
                heads = qkv.view(-1, h + 2 * hkv, d)
                heads[:, :h + hkv] = self._qk(heads, i)
            attn = torch.empty(x.shape[0], h * d)
            self.c.prefill_attention(qkv.data_ptr(), qkv.stride(0), rot.data_ptr(), rot.stride(0), first.data_ptr(),
                                     self.keys[i].data_ptr(), self.values[i].data_ptr(), b, h, hkv, d,
                                     attn.data_ptr(), self._scratch.data_ptr())
            x = self._mlp(x, *rest[:2], attn, *rest[2:])
        self.length = s
        self.slots, self.compact = counts.clone(), True  # each row's tokens from slot 0: no padding stored
        return self._head(x[first[1:] - 1])

    def _prefill_layers(self, rows: int) -> list[tuple]:
        """The layers' operands for the prefill's `rows` rows: the decode steps' own where they are
        packed or the kernel is the same (panels also standing in for a row-major copy: a short
        prefill), else laid out for the prefill alone. The prefill runs once, so the [out, in] weights kept
        for it are released."""
        layers = []
        for weights, decode_ops in zip(self._weights, self.layers, strict=True):
            layer = []
            for i, (t, op) in enumerate(zip(weights, decode_ops, strict=True)):  # weight, bias, weight, …
                kind = None if i % 2 else matmul_kind(t, rows, once=True, panels=self.c_ready)
                packed = isinstance(op, torch.Tensor) and op.is_mkldnn
                same = (kind is None or packed or kind == matmul_kind(t, self.layout_rows, panels=self.c_ready)
                        or isinstance(op, Panels) and kind == "row_major")
                layer.append(op if same else matmul_operand(t, kind, rows, gated=i == GATE_UP))
            layers.append(tuple(layer))
        self._weights = None
        return layers

    def decode(self, tokens: torch.Tensor, rotation: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | Picked:
        """One token per row [B] at the next position (`rotation` [B, 1, head_dim/2]); additive mask
        [B·Hkv, 1, ≥ length+1] over the cache slots or None (all visible) -> logits [B, V] (or
        their `Picked`)."""
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        attend = self._attend
        if self.c is not None:  # the C kernel's operands, once per step for every layer
            attend = self._attend_c
            rotation = torch.view_as_real(rotation.contiguous())  # [B, 1, d/2, 2]: cos, sin
            mask = None if mask is None or self.compact else mask.contiguous()  # compact: no padding to hide
        if self._loop is not None:
            self._loop(x, rotation, mask, self.slots)
        else:
            for i, (wqkv, bqkv, *rest) in enumerate(self.layers):
                qkv = self._normed(x, wqkv, bqkv).view(x.shape[0], self.heads + 2 * self.kv_heads, self.head_dim)
                x = self._mlp(x, *rest[:2], attend(qkv, i, rotation, mask), *rest[2:])
        self.length += 1
        if self.slots is not None:
            self.slots += 1
        return self._head(x)

    def _attend(self, qkv: torch.Tensor, layer: int, rotation: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The step's attention [B, H·d] from its q|k|v heads [B, H + 2·Hkv, d], in torch ops: its k and
        v into the cache, then two batched matmuls over (row, kv head) blocks."""
        b, t, end = qkv.shape[0], self.length, self.length + 1
        d, h, hkv = self.head_dim, self.heads, self.kv_heads
        qk = self._rope(self._qk(qkv, layer), rotation)  # [B, H + Hkv, d]
        self.keys[layer][..., t] = qk[:, h:]
        self.values[layer][:, :, t] = qkv[:, h + hkv:]
        q = qk[:, :h].reshape(b * hkv, h // hkv, d)  # the q heads of each kv head, together
        keys = self.keys[layer].view(b * hkv, d, -1).narrow(2, 0, end)
        scores = torch.bmm(q, keys) if mask is None else torch.baddbmm(mask.narrow(2, 0, end), q, keys)
        return torch.bmm(scores.softmax(-1), self.values[layer].view(b * hkv, -1, d).narrow(1, 0, end)).view(b, h * d)

    def _attend_c(self, qkv: torch.Tensor, layer: int, rot: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`_attend` in one call of cpu_kernels.c's decode_attention (RoPE, cache write, attention);
        `rot` the rotation as contiguous (cos, sin) pairs [B, 1, d/2, 2], `mask` contiguous."""
        b, h, hkv, d = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.qk_norms[layer] is not None:
            qkv[:, :h + hkv] = self._qk(qkv, layer)
        out = torch.empty(b, h * d)
        self.c.decode_attention(qkv.data_ptr(), qkv.stride(0), rot.data_ptr(), rot.stride(0),
                                self.keys[layer].data_ptr(), self.values[layer].data_ptr(), self.slots.data_ptr(),
                                0 if mask is None else mask.data_ptr(), 0 if mask is None else mask.stride(0),
                                b, h, hkv, d, out.data_ptr(), self._scratch.data_ptr())
        return out
