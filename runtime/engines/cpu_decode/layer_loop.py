"""A decode step through every layer of a `FusedDecoder` in one call of cpu_decode.c's
decode_layers: where each layer's matmuls are panels and its attention the C kernel, nothing runs
in Python between them (per layer that was four matmul calls, the attention's and the glue, a few
microseconds each — a sizeable share of a small model's step)."""

from __future__ import annotations

import torch

from hybridflow.runtime.engines.cpu_decode import cpu_kernels
from hybridflow.runtime.engines.cpu_decode.fused_weights import GATE_UP
from hybridflow.runtime.engines.cpu_decode.matmul_kernels import Panels


class LayerLoop:
    """decode_layers' table — per layer the panels' and biases' addresses (q|k|v, o, gate|up, down)
    and its cache's keys and values — and its buffers for up to `batch` rows."""

    def __init__(self, layers: list[tuple], keys: list[torch.Tensor], values: list[torch.Tensor], batch: int,
                 heads: int, kv_heads: int, head_dim: int, norm_eps: float):
        self.heads, self.kv_heads, self.head_dim, self.norm_eps = heads, kv_heads, head_dim, norm_eps
        self._biases = [None if b is None else b.contiguous() for ops in layers for b in ops[1::2]]  # kept alive
        biases = iter(self._biases)
        self._table = torch.tensor([[a for w in ops[0::2] for a in (w.data.data_ptr(), _address(next(biases)))]
                                    + [0, 0] for ops in layers], dtype=torch.long)
        self.retarget(keys, values)
        gate_up = layers[0][GATE_UP]
        self.mlp_features, hidden = gate_up.out_features, gate_up.in_features
        self._buffers = [torch.empty(batch, n) for n in ((heads + 2 * kv_heads) * head_dim, heads * head_dim,
                                                          self.mlp_features, hidden)]
        self._scratch = torch.empty(batch * heads * (head_dim + 2))

    @staticmethod
    def applies(layers: list[tuple], qk_norms: list) -> bool:
        """Every layer's four weights packed as panels, no per-head q/k norm (Qwen3's runs as torch
        ops between the matmuls)."""
        return all(norm is None for norm in qk_norms) and all(isinstance(w, Panels) for ops in layers for w in ops[0::2])

    def retarget(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """The caches' new addresses (the decoder reallocates them when rows leave the batch)."""
        self._table[:, -2] = torch.tensor([k.data_ptr() for k in keys])
        self._table[:, -1] = torch.tensor([v.data_ptr() for v in values])

    def __call__(self, x: torch.Tensor, rotation: torch.Tensor, mask: torch.Tensor | None, slots: torch.Tensor) -> None:
        """x [B, hidden] (contiguous) through every layer, in place; rotation [B, 1, d/2, 2] (cos, sin)
        and mask [B·Hkv, 1, ≥ slots+1] (or None) contiguous; the step's k, v into each row's cache
        slot slots[b] (int64)."""
        buffers = [t.data_ptr() for t in self._buffers]
        cpu_kernels.kernels().decode_layers(
            len(self._table), self._table.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], self.mlp_features,
            rotation.data_ptr(), rotation.stride(0), slots.data_ptr(), _address(mask),
            0 if mask is None else mask.stride(0), self.heads, self.kv_heads, self.head_dim, self.norm_eps, *buffers,
            self._scratch.data_ptr())


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
