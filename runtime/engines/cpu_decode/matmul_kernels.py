"""The fused decode path's matmul kernels: which kernel each weight gets for the rows it multiplies
(`matmul_kind`), the weight laid out for it (`matmul_operand`), and the call (`linear`: residual +
x @ W.T + bias in one call, whatever the kernel). fast_decode.py lays out a model's weights with
these once per generate() call; tools/bench/rollout_speed.py times them for its matmul floor."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.runtime.engines.cpu_decode import cpu_kernels

# The kernel of each matmul, chosen per weight from the rows it multiplies (measured on this
# project's AMD EPYC CPU, 1 thread, fp32): oneDNN's linear on a weight prepacked once (what torch
# inductor's CPU "freezing" path uses) runs these shapes nearer the CPU's peak than MKL's sgemm
# behind `x @ w`, but has a bigger fixed cost per call — so it wins on a big weight from 2 rows (a
# few rows stream the packed weight instead of packing themselves) and on any weight from
# PACKED_MIN_ROWS rows (a prefill); small weights at fewer rows go to MKL.
PACKED_MIN_SIZE = 2 ** 18  # elements: 1 MB in fp32
PACKED_MIN_ROWS = 512
# Up to this many rows MKL reads a row-major [in, out] copy faster (in memory order); beyond, the
# [out, in] weight's transposed view is as fast and costs no copy.
ROW_MAJOR_MAX_BATCH = 16
# cpu_kernels.c's panel_matmul, on a weight packed in panels, beats both at a few rows: a step of
# a small batch is bound by streaming the weights from memory, which it does at about the memory's
# speed (MKL's and oneDNN's kernels at about half of it on these shapes). Built with AVX-512 its
# 8-row tile also keeps the FMA units busy: a third faster than oneDNN at 16 rows, even at 64 and
# within a few percent at 512, so it takes every row count there; without, up to PANEL_MAX_ROWS.
# There (AVX2: 4-row tiles) each panel is read from memory once per block of rows and stays in
# cache for the block's tiles, so whole decode steps still run faster through it than through
# MKL/oneDNN well past one tile, up to about this many rows (docs/engines.md, measured).
PANEL_MAX_ROWS = 128
MATMUL_KINDS = ("packed", "row_major", "view", "panel")


def packable(w: torch.Tensor | RowBlocks) -> bool:
    """Whether weight w may take the "packed" kernel: fp32 on CPU with oneDNN, the case measured."""
    return w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def c_matmul_ready(w: torch.Tensor | RowBlocks) -> bool:
    """Whether cpu_kernels.c's panel_matmul can run on weight w: fp32 on CPU, one torch thread (the
    kernel is single-threaded), the library built."""
    return (w.device.type == "cpu" and w.dtype == torch.float32 and torch.get_num_threads() == 1
            and cpu_kernels.kernels() is not None)


def matmul_kind(w: torch.Tensor | RowBlocks, rows: int, once: bool = False, panels: bool = False) -> str:
    """The kernel for weight w [out, in] on `rows` rows (one of MATMUL_KINDS; comments above). `once`:
    the operand serves a single matmul (a prefill), and packing, about a pass over the weight,
    pays for itself there only from PACKED_MIN_ROWS rows. `panels`: the C kernels may be used."""
    if panels and c_matmul_ready(w) and (rows <= PANEL_MAX_ROWS or cpu_kernels.kernels().panel_tile_rows() >= 8):
        return "panel"
    if packable(w) and rows > 1 and (rows >= PACKED_MIN_ROWS or (w.numel() >= PACKED_MIN_SIZE and not once)):
        return "packed"
    return "row_major" if rows <= ROW_MAJOR_MAX_BATCH else "view"


class RowBlocks:
    """A weight [out, in] not yet concatenated: its row blocks one after another, each a weight
    [o, in] with its rows in `order` (None: as they are) times `scale`, and every input feature
    times `col` (None: 1) — a fused q|k|v or gate|up with its norm's weight folded in. The C kernels
    pack panels straight from the blocks (one pass over the weights); `tensor()` builds the
    concatenation for the others."""

    def __init__(self, blocks: list[tuple[torch.Tensor, torch.Tensor | None, float]], col: torch.Tensor | None = None):
        # rows contiguous (a copy where they are not, kept here: row_addresses points into it)
        self.blocks = [(w.detach() if w.stride(-1) == 1 else w.detach().contiguous(), order, scale)
                       for w, order, scale in blocks]
        self.col = None if col is None else col.detach()
        first = self.blocks[0][0]
        rows = sum(w.shape[0] if order is None else len(order) for w, order, _ in self.blocks)
        self.shape, self.device, self.dtype = torch.Size((rows, first.shape[1])), first.device, first.dtype

    def numel(self) -> int:
        return self.shape.numel()

    def tensor(self) -> torch.Tensor:
        w = torch.cat([(w if order is None else w[order]) * scale for w, order, scale in self.blocks])
        return w if self.col is None else w * self.col

    def row_addresses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's address (int64) and scale, in order, for cpu_kernels.c's pack_panels."""
        addresses, scales = [], []
        for w, order, scale in self.blocks:
            rows = torch.arange(w.shape[0]) if order is None else order
            addresses.append(w.data_ptr() + rows * (w.stride(0) * w.element_size()))
            scales.append(torch.full((len(rows),), scale))
        return torch.cat(addresses), torch.cat(scales)


def weight_tensor(w: torch.Tensor | RowBlocks) -> torch.Tensor:
    return w.tensor() if isinstance(w, RowBlocks) else w.detach()


class Panels:
    """A weight [out, in] packed for cpu_kernels.c's panel_matmul: [ceil(out / PANEL), in, PANEL],
    the last panel's missing rows zero. `gated`: the weight is gate | up [2·F, in], packed as the
    gate's panels then the up's, and a call returns silu(gate)·up [rows, F]. `empty(*shape)`: where
    the panels go (kept_memory.KeptMemory.empty: memory kept from call to call)."""

    def __init__(self, w: torch.Tensor | RowBlocks, gated: bool = False, empty: Callable = torch.empty):
        blocks = w if isinstance(w, RowBlocks) else RowBlocks([(w, None, 1.0)])
        self.gated = gated
        self.out_features = blocks.shape[0] // 2 if gated else blocks.shape[0]
        self.in_features = blocks.shape[1]
        addresses, scales = blocks.row_addresses()
        col = None if blocks.col is None else blocks.col.contiguous()
        width = cpu_kernels.PANEL
        pad = -self.out_features % width  # each half of gate | up in whole panels
        halves = addresses.chunk(2) if gated else (addresses,)
        addresses = torch.cat([F.pad(a, (0, pad)) for a in halves])
        scales = torch.cat([F.pad(c, (0, pad)) for c in (scales.chunk(2) if gated else (scales,))])
        self.data = empty(len(addresses) // width, self.in_features, width)
        cpu_kernels.kernels().pack_panels(addresses.data_ptr(), scales.data_ptr(),
                                          None if col is None else col.data_ptr(),
                                          len(addresses), self.in_features, self.data.data_ptr())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                 norm_eps: float | None = None, pick: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """residual + norm(x) @ W.T + bias (or silu·up of it, gated), norm(x) = x / sqrt(sum(x²) +
        norm_eps) per row, or x where norm_eps is None. `pick`: the outputs are logits, and what
        comes back is each row's greedy pick from them, (tokens [rows], log-probs [rows]), the
        logits never written (cpu_matmul.c)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        bias = None if bias is None else bias.contiguous()
        rows = x.shape[0]
        y = None if pick else torch.empty(rows, self.out_features)
        tokens, logp = (torch.empty(rows, dtype=torch.long), torch.empty(rows)) if pick else (None, None)
        cpu_kernels.kernels().panel_matmul(
            x.data_ptr(), x.stride(0), rows, self.data.data_ptr(), self.out_features, self.in_features,
            None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0), None if pick else y.data_ptr(),
            -1.0 if norm_eps is None else norm_eps, self.gated,
            None if tokens is None else tokens.data_ptr(), None if logp is None else logp.data_ptr())
        return (tokens, logp) if pick else y


def matmul_operand(w: torch.Tensor | RowBlocks, kind: str, rows: int, gated: bool = False,
                   empty: Callable = torch.empty) -> torch.Tensor | Panels:
    """Weight [out, in] as `linear`'s right operand for `kind`: oneDNN's packed tensor (laid out for
    about `rows` rows; any row count runs on it), a row-major [in, out] copy, the [in, out] view, or
    the C kernel's panels (`gated`: of a gate | up weight, computing silu(gate)·up)."""
    if kind == "panel":
        return Panels(w, gated, empty)
    w = weight_tensor(w)
    if kind == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(w, rows)
    return w.t().contiguous() if kind == "row_major" else w.t()


def matmul_layout(w: torch.Tensor | RowBlocks, rows: int, panels: bool = False, gated: bool = False,
                  empty: Callable = torch.empty) -> torch.Tensor | Panels:
    """Weight [out, in] as the right operand of the kernel `matmul_kind` picks for `rows` rows
    (`gated`: panels of a gate | up weight, as in matmul_operand)."""
    return matmul_operand(w, matmul_kind(w, rows, panels=panels), rows, gated, empty)


def linear(x: torch.Tensor, w: torch.Tensor | Panels, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ W.T + bias for rows x [M, in] and the operand w of weight W (`matmul_operand`),
    in one call: panels through the C kernel, a packed weight through oneDNN (its binary form adds
    the residual), else `addmm`."""
    if isinstance(w, Panels):
        return w(x, bias, residual)
    if w.is_mkldnn:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, bias, "add")
    if residual is None:
        return x @ w if bias is None else torch.addmm(bias, x, w)
    return torch.addmm(residual if bias is None else residual + bias, x, w)
