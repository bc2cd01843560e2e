"""The Megatron engine's weights in HF names: loading our decoder's weights into this rank's stage,
tensor-parallel shards for the 3D-HybridEngine (engines/rollout/hybrid.py) and whole weights for export.

A rank holds one pipeline stage (its layers renumbered from 0), its tensor-parallel shard of each
tensor, and of a MoE layer the experts of its ep rank (renumbered from 0). `_stage_names` maps the
global megatron names (engines/train/megatron/weights.py) to the stage's own. Experts are whole on every tp
rank; what generation or export needs of the other ep ranks' experts is gathered over the ep group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from hybridflow.runtime.engines.train.megatron.weights import (
    hf_to_megatron,
    hf_tp_dim,
    is_expert,
    layer_index,
    megatron_to_hf,
    stage_layers,
    to_local_expert,
    to_local_layer,
    tp_shard,
    tp_unshard,
)


class MegatronShards:
    """Mixed into MegatronEngine: needs `module`, `decoder_config`, `parallel`, `head`, `is_lm`,
    `tp_rank`, `pp_rank`, `ep_rank`, `first_stage`, `last_stage`."""

    def _stage_names(self) -> dict[str, str]:
        return self._stage_names_of(self.module)

    def _stage_names_of(self, module) -> dict[str, str]:
        """Global megatron name -> the stage's own parameter name, for the tensors the rank holds."""
        layers = stage_layers(self.decoder_config, self.pp_rank, self.parallel.pp)
        first_expert = self.ep_rank * (self.decoder_config.num_local_experts or 0) // self.parallel.ep
        out = {}
        for local, t in module.state_dict().items():
            if local.endswith("_extra_state") or not isinstance(t, torch.Tensor):
                continue
            name = local if layer_index(local) is None else to_local_layer(local, -layers.start)
            out[to_local_expert(name, -first_expert)] = local
        return out

    @torch.no_grad()
    def _load_hf(self, module, hf_state: dict[str, torch.Tensor]) -> None:
        mg = hf_to_megatron(hf_state, self.decoder_config)
        if self.decoder_config.tie_word_embeddings and self.is_lm and self.last_stage and not self.first_stage:
            mg["output_layer.weight"] = mg["embedding.word_embeddings.weight"]  # the last stage's copy
        own = module.state_dict()
        for global_name, local in self._stage_names_of(module).items():
            own[local].copy_(tp_shard(global_name, mg[global_name], self.tp_rank, self.parallel.tp,
                                      scalar_head=not self.is_lm))

    def _with_all_experts(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`mine` plus the experts the other ep ranks hold (global names): the same local experts of
        each rank have the same shapes, so one all-gather per tensor."""
        if self.parallel.ep == 1:
            return mine
        from megatron.core import parallel_state as ps

        ep, per_rank = self.parallel.ep, self.decoder_config.num_local_experts // self.parallel.ep
        first = self.ep_rank * per_rank
        out = dict(mine)
        for name in sorted(n for n in mine if is_expert(n)):  # the same order on every ep rank
            parts = [torch.empty_like(mine[name]) for _ in range(ep)]
            dist.all_gather(parts, mine[name].contiguous(), group=ps.get_expert_model_parallel_group())
            for r, part in enumerate(parts):
                out[to_local_expert(name, first - r * per_rank)] = part
        return out

    # ---- tensor-parallel shards in HF names (the 3D-HybridEngine's source, engines/rollout/hybrid.py) ----
    def _tied(self) -> bool:
        return self.is_lm and self.decoder_config.tie_word_embeddings

    def tp_shard_dims(self) -> dict[str, int | None]:
        """For each HF-named tensor this stage holds, the dim split over tensor parallelism (None: whole)."""
        return {n: hf_tp_dim(n, self._tied()) for n in self.tp_shards()}

    @contextmanager
    def gathered_tp_shards(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's tensor-parallel shard of every parameter of its stage, in HF names. Megatron keeps
        the weights whole over dp (its distributed optimizer shards only optimizer states), so nothing
        is gathered but a tied embedding, which the generation layout keeps whole, and the experts of
        the other ep ranks."""
        yield self.tp_shards()

    @torch.no_grad()
    def tp_shards(self) -> dict[str, torch.Tensor]:
        own = self.module.state_dict()
        mine = self._with_all_experts({g: own[local].detach() for g, local in self._stage_names().items()})
        if self._tied():
            mine.pop("output_layer.weight", None)  # the last stage's copy of the embedding
            if "embedding.word_embeddings.weight" in mine and self.parallel.tp > 1:
                from megatron.core import parallel_state as ps

                t = mine["embedding.word_embeddings.weight"]
                shards = [torch.empty_like(t) for _ in range(self.parallel.tp)]
                dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
                mine["embedding.word_embeddings.weight"] = torch.cat(shards)
        hf = megatron_to_hf(mine, self.decoder_config, self.head, tp=self.parallel.tp)
        if self._tied() and "model.embed_tokens.weight" in hf and self.last_stage:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return hf

    @torch.no_grad()
    def load_tp_shards(self, shards: dict[str, torch.Tensor]) -> None:
        """The inverse of tp_shards: HF-named shards of this rank back into its megatron parameters
        (of the experts, its own; of a tied embedding, which tp_shards gives whole, its shard)."""
        mg = hf_to_megatron({k: v for k, v in shards.items() if k != "lm_head.weight" or not self._tied()},
                            self.decoder_config, tp=self.parallel.tp)
        embedding = "embedding.word_embeddings.weight"
        if self._tied() and embedding in mg:
            mg[embedding] = tp_shard(embedding, mg[embedding], self.tp_rank, self.parallel.tp)
        own = self.module.state_dict()
        for g, local in self._stage_names().items():
            if g in mg:
                own[local].copy_(mg[g])

    # ---- generation frees the training weights (engines/rollout/hybrid.py, release_training) ----------
    def _ddp_buffers(self) -> list:
        return self.model.buffers + self.model.expert_parallel_buffers

    @torch.no_grad()
    def release_weights(self, held_elsewhere: set[str]) -> dict[str, int]:
        """Free the storage of megatron's contiguous weight and gradient buffers (every parameter and
        its main_grad are views into them: the buffers are freed whole, whichever parameters
        `held_elsewhere` names) while the generation weights hold the weights: what
        `restore_weights` and then load_tp_shards put back. Gradients are zeroed before each step, so
        they need no copy; the optimizer's states stay. A tied LM head on a later pipeline stage than
        the embedding is not in this stage's generation shards: it is kept aside. -> buffer: bytes."""
        own = self.module.state_dict()
        self._kept = {"output_layer.weight": own["output_layer.weight"].clone()} \
            if self._tied() and self.last_stage and not self.first_stage else {}
        freed = {}
        for i, buf in enumerate(self._ddp_buffers()):
            for kind in ("param_data", "grad_data"):
                storage = getattr(buf, kind).untyped_storage() if getattr(buf, kind) is not None else None
                if storage is not None and storage.nbytes():
                    freed[f"{i}.{kind}"] = storage.nbytes()
                    storage.resize_(0)
        return freed

    @torch.no_grad()
    def restore_weights(self, freed: dict[str, int]) -> None:
        """Reallocate what release_weights freed (gradients zero); the weights are then loaded with
        load_tp_shards from the generation weights."""
        for i, buf in enumerate(self._ddp_buffers()):
            for kind in ("param_data", "grad_data"):
                if f"{i}.{kind}" in freed:
                    getattr(buf, kind).untyped_storage().resize_(freed[f"{i}.{kind}"])
            buf.grad_data.zero_()
        own = self.module.state_dict()
        for local, t in self._kept.items():
            own[local].copy_(t)
        self._kept = {}

    # ---- weights out: HF names (export) -------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Whole fp32 weights in HF names on CPU, on every rank (gathered over tp, ep and pp)."""
        from megatron.core import parallel_state as ps

        own = self.module.state_dict()
        mine = {g: own[local].detach().float().cpu() for g, local in self._stage_names().items()}
        tp_group = ps.get_tensor_model_parallel_group()
        whole = {}
        for name, t in mine.items():
            if is_expert(name):  # whole on each tp rank
                whole[name] = t
                continue
            shards = [torch.empty_like(t) for _ in range(self.parallel.tp)]
            dist.all_gather(shards, t.contiguous(), group=tp_group)
            whole[name] = tp_unshard(name, shards, scalar_head=not self.is_lm)
        whole = self._with_all_experts(whole)
        if self.parallel.pp > 1:
            stages = [None] * self.parallel.pp
            dist.all_gather_object(stages, whole, group=ps.get_pipeline_model_parallel_group())
            whole = {}
            for s in stages:  # the last stage's copy of a tied embedding is the first's
                whole |= {k: v for k, v in s.items() if k not in whole}
        if self.decoder_config.tie_word_embeddings and self.is_lm:
            whole.pop("output_layer.weight", None)
        hf = megatron_to_hf(whole, self.decoder_config, self.head)
        if self.is_lm and self.decoder_config.tie_word_embeddings:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return {} if rank0_only and dist.get_rank() != 0 else hf
