"""The FSDP2 engine's weights as other parts of the system see them: the frozen base under LoRA
(`base_policy`), the adapters alone (what a LoRA weight sync sends), and the tensor-parallel shards the
3D-HybridEngine reads and writes (gathered over dp by FSDP2's own unshard), with the zero-redundancy switch
that frees a training slice while the generation weights hold it (engines/rollout/hybrid.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.parallelize import load_tp_local, tp_local, tp_shard_dim
from hybridflow.runtime.engines.train.lora import adapters_disabled
from hybridflow.runtime.models.lora_files import is_adapter, merged_state, plain_name


class FsdpWeightViews:
    """Mixed into FsdpEngine: needs `model`, `lora`, `_adapters_off` and `_fsdp_units`."""

    @contextmanager
    def base_policy(self) -> Iterator[None]:
        """The frozen base model inside the `with` (LoRA: adapters off); without LoRA, the model itself."""
        if self.lora is None:
            yield
            return
        with adapters_disabled(self.model):
            self._adapters_off = True
            try:
                yield
            finally:
                self._adapters_off = False

    @torch.no_grad()
    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """Every adapter's whole tensor (gathered over dp and tp: a collective on every rank), our names."""
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for n, p in self.model.named_parameters() if is_adapter(n)}

    # ---- tensor-parallel shards (the 3D-HybridEngine's input and output) ------------------------
    def tp_shard_dims(self) -> dict[str, int | None]:
        """For each parameter, the dimension split over tensor parallelism (None: replicated); under LoRA,
        of the plain model's weights (a wrapped layer's as its base layer's)."""
        dims = {n: tp_shard_dim(p) for n, p in self.model.named_parameters()}
        return dims if self.lora is None else {plain_name(n): d for n, d in dims.items() if not is_adapter(n)}

    @contextmanager
    def gathered_tp_shards(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's tensor-parallel shard of every parameter, gathered over dp under FSDP; valid
        inside the `with` only. FSDP2's own unshard moves each FSDP unit (a decoder layer, the root)
        in one all-gather, all units in flight at once: a collective per parameter instead is latency-
        bound on gloo (tiny model, dp 2: ~40 all-gathers, 71 ms, vs 5 in 19 ms). Under LoRA: the merged
        weights W + scale·B·A under the plain model's names (new tensors; B's or A's local slice is the shard's),
        or inside base_policy() the frozen base's."""
        def view():
            shards = {n: tp_local(p.detach()) for n, p in self.model.named_parameters()}
            if self.lora is None:
                return shards
            if self._adapters_off:  # base_policy(): the frozen weights themselves
                return {plain_name(n): t for n, t in shards.items() if not is_adapter(n)}
            return merged_state(shards, self.lora)

        with torch.no_grad():
            if not self._fsdp_units:
                yield view()
                return
            handles = [unit.unshard(async_op=True) for unit in self._fsdp_units]
            try:
                for h in handles:
                    h.wait()
                yield view()
            finally:
                for unit in self._fsdp_units:
                    unit.reshard()

    def tp_shards(self) -> dict[str, torch.Tensor]:
        """gathered_tp_shards, kept: under FSDP copied out of the gather buffers, which are freed."""
        with self.gathered_tp_shards() as shards:
            return {n: t.clone() for n, t in shards.items()} if self._fsdp_units else shards

    @torch.no_grad()
    def load_tp_shards(self, shards: Mapping[str, torch.Tensor]) -> None:
        for n, p in self.model.named_parameters():
            load_tp_local(p.data if not isinstance(p, DTensor) else p, shards[n])

    # ---- the hybrid engine's zero-redundancy switch (engines/rollout/hybrid.py) -------------------
    @torch.no_grad()
    def release_weights(self, held_elsewhere: set[str]) -> dict[str, int]:
        freed = {}
        if self.lora is not None:  # the generation weights are merged, not the frozen base: keep it
            return freed
        for n, p in self.model.named_parameters():
            if n in held_elsewhere:  # a slice of the generation weights
                storage = _storage(p)
                freed[n] = storage.nbytes()
                storage.resize_(0)
        return freed

    @torch.no_grad()
    def restore_weights(self, freed: dict[str, int]) -> None:
        for n, p in self.model.named_parameters():
            if n in freed:
                _storage(p).resize_(freed[n])


def _storage(p: torch.Tensor):
    """The storage of this rank's own part of a parameter (its local shard under FSDP or TP)."""
    return (p.to_local() if isinstance(p, DTensor) else p.data).untyped_storage()
