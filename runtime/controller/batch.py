"""Batch: what flows between the driver and the worker groups.

A Batch is `n` samples with three kinds of content:

- `tensors`: a `TensorDict` with batch size `[n]` (token ids, masks, log-probs, values, ...);
- `non_tensors`: per-sample Python objects (prompt strings, ground-truth answers), kept as numpy
  object arrays of length `n` so they index and concatenate like the tensors;
- `meta`: one dict for the whole batch (temperature, the iteration, timings) — not split.

Every operation returns a new Batch (the inputs are not modified, tensors may be shared):
`chunk`, `concat`, `pad_to_multiple` / `unpad`, `select`, `union`, `repeat_interleave`, indexing.
Batches pickle, so they travel through Ray's object store as they are.

    b = Batch({"input_ids": ids}, non_tensors={"prompt": prompts}, meta={"temperature": 1.0})
    b["values"] = v                 # add a field (tensor or per-sample objects)
    parts = b.chunk(4)              # 4 equal parts; pad_to_multiple(4) first if n % 4
    whole = Batch.concat(parts)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from hybridflow.runtime.controller.tensordict_import import TensorDict
from hybridflow.simulator.errors import HflowError


def _object_array(values: Iterable[Any]) -> np.ndarray:
    """A 1-D numpy object array, even when the items are themselves sequences."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


class Batch:
    """`n` samples: a TensorDict of tensor fields, per-sample non-tensor fields and batch meta."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
                 non_tensors: Mapping[str, Iterable[Any]] | None = None,
                 meta: Mapping[str, Any] | None = None, batch_size: int | None = None):
        nt = {k: v if isinstance(v, np.ndarray) and v.dtype == object and v.ndim == 1 else _object_array(v)
              for k, v in (non_tensors or {}).items()}
        sizes = {len(v) for v in nt.values()}
        if tensors is not None and len(tensors.keys()) > 0:
            if isinstance(tensors, TensorDict) and tensors.batch_dims >= 1:
                sizes.add(tensors.batch_size[0])
            else:
                sizes |= {t.shape[0] for t in tensors.values()}
        if batch_size is not None:
            sizes.add(batch_size)
        if len(sizes) > 1:
            raise HflowError(f"batch fields disagree on the number of samples ({sorted(sizes)}); "
                             "give every field the same first dimension")
        n = sizes.pop() if sizes else 0
        if isinstance(tensors, TensorDict) and tensors.batch_size == torch.Size([n]):
            td = tensors
        else:
            td = TensorDict(dict(tensors.items()) if tensors is not None else {}, batch_size=[n])
        self.tensors: TensorDict = td
        self.non_tensors: dict[str, np.ndarray] = nt
        self.meta: dict[str, Any] = dict(meta or {})

    # ---- views --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.tensors.batch_size[0]

    def keys(self) -> list[str]:
        return list(self.tensors.keys()) + list(self.non_tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def __getitem__(self, item):
        """`b["field"]` is a field; `b[3]`, `b[2:5]`, `b[index_tensor]` are sub-batches."""
        if isinstance(item, str):
            if item in self.non_tensors:
                return self.non_tensors[item]
            if item in self.tensors.keys():
                return self.tensors[item]
            raise KeyError(f"batch has no field '{item}' (fields: {', '.join(self.keys()) or 'none'})")
        if isinstance(item, int):
            item = slice(item, item + 1 if item != -1 else None)
        if isinstance(item, (list, np.ndarray)):
            item = torch.as_tensor(item, dtype=torch.long)
        idx = item.numpy() if isinstance(item, torch.Tensor) else item
        return Batch(self.tensors[item], {k: v[idx] for k, v in self.non_tensors.items()}, self.meta)

    def __setitem__(self, key: str, value) -> None:
        if len(value) != len(self):
            raise HflowError(f"field '{key}' has {len(value)} samples but the batch has {len(self)}")
        if isinstance(value, torch.Tensor):
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            if key in self.tensors.keys():
                del self.tensors[key]
            self.non_tensors[key] = value if isinstance(value, np.ndarray) and value.dtype == object \
                else _object_array(value)

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self.tensors.items()]
        fields += [f"{k}: [{len(v)}] object" for k, v in self.non_tensors.items()]
        return f"Batch(n={len(self)}, {', '.join(fields)}, meta={sorted(self.meta)})"

    # ---- reshaping ----------------------------------------------------------------------------
    def select(self, *keys: str, meta: bool = True) -> Batch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no field(s) {missing} (fields: {', '.join(self.keys())})")
        tkeys = [k for k in keys if k in self.tensors.keys()]
        return Batch(self.tensors.select(*tkeys), {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
                     self.meta if meta else None, batch_size=len(self))

    def union(self, other: Batch) -> Batch:
        """All fields of both; a field in both must hold equal values (meta: `other` wins)."""
        if len(other) != len(self):
            raise HflowError(f"cannot union batches of {len(self)} and {len(other)} samples")
        tensors = self.tensors.clone(recurse=False)
        for k, v in other.tensors.items():
            if k in tensors.keys() and not torch.equal(tensors[k], v):
                raise HflowError(f"cannot union batches: field '{k}' differs; rename one of them")
            tensors[k] = v
        nt = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in nt and not np.array_equal(nt[k], v):
                raise HflowError(f"cannot union batches: field '{k}' differs; rename one of them")
            nt[k] = v
        return Batch(tensors, nt, {**self.meta, **other.meta})

    def chunk(self, parts: int) -> list[Batch]:
        """`parts` equal consecutive pieces; the size must divide (use `pad_to_multiple` first)."""
        if parts < 1 or len(self) % parts:
            raise HflowError(f"cannot split a batch of {len(self)} samples into {parts} equal parts; "
                             f"pad it first (batch.pad_to_multiple({parts}))")
        size = len(self) // parts
        return [self[i * size:(i + 1) * size] for i in range(parts)]

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Samples of all batches in order; fields must match; meta comes from the first."""
        if not batches:
            raise HflowError("cannot concatenate an empty list of batches")
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise HflowError(f"cannot concatenate batches with different fields: {sorted(keys)} vs {sorted(b.keys())}")
        tensors = torch.cat([b.tensors for b in batches], dim=0)
        nt = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return Batch(tensors, nt, batches[0].meta, batch_size=sum(len(b) for b in batches))

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Append copies of the first samples (cyclically) so that `multiple` divides the size.
        Returns the padded batch and the number of samples added, for `unpad`."""
        pad = -len(self) % multiple
        if pad == 0:
            return self, 0
        if len(self) == 0:
            raise HflowError("cannot pad an empty batch; give at least one sample")
        idx = torch.arange(pad) % len(self)
        return Batch.concat([self, self[idx]]), pad

    def unpad(self, pad: int) -> Batch:
        return self[: len(self) - pad] if pad else self

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each sample `repeats` times in a row (GRPO/RLOO: n responses per prompt)."""
        idx = torch.arange(len(self)).repeat_interleave(repeats)
        return self[idx]

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.tensors.to(device), self.non_tensors, self.meta)

    def equals(self, other: Batch) -> bool:
        """Same fields, same values (exactly), same meta."""
        return (isinstance(other, Batch) and len(self) == len(other) and set(self.keys()) == set(other.keys())
                and all(torch.equal(v, other.tensors[k]) for k, v in self.tensors.items())
                and all(np.array_equal(v, other.non_tensors[k]) for k, v in self.non_tensors.items())
                and self.meta == other.meta)
