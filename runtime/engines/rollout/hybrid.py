"""HybridEngine: the actor's training layout and generation layout on the same devices.

It holds a FsdpEngine (training layout (p, t, d): pipeline stages, FSDP2 + TP) and a whole
(not pipelined, p_g = 1) generation model sharded
with the generation tensor size t_g over the Resharder's generation groups, and switches weights
between them with the 3D-HybridEngine reshard:

    hybrid = HybridEngine(trainer, CausalLM(cfg), ParallelConfig(tp=t_g, dp=world // t_g))
    stats = hybrid.to_generation(release_training=True)  # all-gather in micro-DP groups; frees the
    rollout = hybrid.generate(prompt_ids, mask, SamplingParams(greedy=True))  # trainer's weights
    hybrid.to_training()                    # own slice back into the trainer: no communication

It is the `native` backend of the rollout interface (rollout.py): `update_weights()` is
`to_generation()`. Workers (Ray) wrap it; it knows nothing of Ray.

A LoRA trainer (engines/train/lora.py) is switched once in full — its frozen base, resharded as above —
and the generation engine keeps that base slice of each wrapped layer; every switch after that moves
only the adapters (whole, gathered over the trainer's ranks: `bytes_received` is their bytes) and merges
them into the generation weights, W_g = W_base,g + scale·(B·A)_g for this device's generation slice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.parallelize import apply_tp, device_type, tp_plan_dims
from hybridflow.runtime.engines.rollout.base import RolloutEngine
from hybridflow.runtime.engines.rollout.generation import GenerationEngine, Rollout, SamplingParams
from hybridflow.runtime.engines.rollout.reshard import Resharder, ReshardStats
from hybridflow.runtime.engines.train.base import TrainEngine
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p.data


class HybridEngine(RolloutEngine):
    backend = "native"

    def __init__(self, trainer: TrainEngine, generation_model: nn.Module, generation: ParallelConfig,
                 mode: str = "hybridflow"):
        train = trainer.parallel
        if generation.pp != 1:
            raise HflowError(f"generation is not pipelined on this runtime (got {generation}); use a generation "
                             "layout with pp=1 (training may use any pp)")
        if generation.world_size != train.world_size:
            raise HflowError(f"generation config {generation} uses {generation.world_size} devices but training "
                             f"config {train} uses {train.world_size}; they share the same devices")
        self.trainer = trainer
        self.resharder = Resharder(t=train.tp, t_g=generation.tp, d=train.dp, mode=mode, p=train.pp)
        self.model = generation_model.to(trainer.device)
        self.staged = None  # p > 1: (split dims, stage) of every parameter of the whole model
        if train.pp > 1:
            from hybridflow.runtime.engines.train.fsdp.pipeline import param_stages
            self.staged = (tp_plan_dims(self.model), param_stages(self.model, train.pp))
        if generation.tp > 1:
            apply_tp(self.model, self.resharder.generation_mesh(device_type())["tp"])
        self.model.eval()
        self.engine = GenerationEngine(self.model)
        self.engine.clock = trainer.clock  # one phase clock per actor: its generation and training phases
        self.dims = trainer.tp_shard_dims()
        self.lora = getattr(trainer, "lora", None)
        self._lora_base: dict[str, torch.Tensor] | None = None  # LoRA: the base's generation slice per wrapped layer
        self.last_stats: ReshardStats | None = None
        self._released: dict[str, int] = {}  # parameter -> storage bytes freed by to_generation

    def to_generation(self, release_training: bool = False) -> ReshardStats:
        """Load the trainer's current weights into the generation model (the 3D-HybridEngine switch).

        `release_training=True` (HybridFlow grouping) then frees the trainer's sharded weights: the
        device's training shard survives only as a slice of its generation weights, so no device
        holds a redundant copy; `to_training()` rebuilds it from there without communication.
        """
        if release_training and self.resharder.layout.mode != "hybridflow":
            raise HflowError(f"mode '{self.resharder.layout.mode}' cannot rebuild the training weights from the "
                             "generation weights; release_training needs mode 'hybridflow'")
        target = {n: _local(p) for n, p in self.model.named_parameters()}
        if self.lora is not None:
            return self._lora_to_generation(target)
        with self.trainer.gathered_tp_shards() as shards:  # under FSDP: all-gather over dp first
            if self.staged is None:
                _, stats = self.resharder.to_generation(shards, self.dims, out=target)
            else:
                stats = self.resharder.to_generation_staged(shards, *self.staged, out=target)
            d = self.trainer.parallel.dp
            stats.dp_gather_bytes = sum(v.numel() * v.element_size() for v in shards.values()) * (d - 1) // d
        if release_training:  # the trainer's own slices live on inside the generation weights
            self._released = self.trainer.release_weights(set(self.resharder.own_views))
        self.last_stats = stats
        return stats

    def update_weights(self) -> int:
        return self.to_generation().bytes_received

    @torch.no_grad()
    def _lora_to_generation(self, target: dict[str, torch.Tensor]) -> ReshardStats:
        """The LoRA switch: the base once (resharded in full), then the adapters alone, merged here."""
        first = None
        if self._lora_base is None:
            with self.trainer.base_policy(), self.trainer.gathered_tp_shards() as shards:
                _, first = self.resharder.to_generation(shards, self.dims, out=target)
            self._lora_base = {}
        adapters = self.trainer.adapter_tensors()  # collective: whole A and B on every rank
        _, k = self.generation_ranks(self.trainer.rank)
        t_g = self.resharder.layout.t_g
        received = 0
        for name, a in adapters.items():
            if ".lora_A." not in name:
                continue
            prefix = name.split(".lora_A.")[0]
            b = adapters[name.replace(".lora_A.", ".lora_B.")]
            received += a.numel() * a.element_size() + b.numel() * b.element_size()
            weight = prefix + ".weight"
            dim = self.dims.get(weight) if t_g > 1 else None
            if dim == 0:  # column-wise: this slice's rows of B·A
                b = b.chunk(t_g, 0)[k]
            elif dim == 1:  # row-wise: its columns
                a = a.chunk(t_g, 1)[k]
            base = self._lora_base.setdefault(weight, target[weight].clone())
            target[weight].copy_((base.float() + self.lora.scale * (b.float() @ a.float())).to(base.dtype))
        stats = first or ReshardStats(mode=self.resharder.layout.mode)
        stats.bytes_received = received if first is None else first.bytes_received + received
        stats.lora_adapter_bytes = received
        self.last_stats = stats
        return stats

    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 lengths: torch.Tensor | None = None) -> Rollout:
        return self.engine.generate(prompt_ids, attention_mask, params, generator, lengths)

    def generation_ranks(self, rank: int) -> tuple[int, int]:
        lay = self.resharder.layout
        return lay.generation_replica(rank), lay.generation_coords(rank)[1]

    def to_training(self) -> None:
        """Back to the training layout. Without a release the trainer's weights were never touched,
        so nothing moves; after a release each device copies its own slice of the generation
        weights back into the trainer (bit-identical, no communication)."""
        if not self._released:
            return
        self.trainer.restore_weights(self._released)
        gen = {n: _local(p) for n, p in self.model.named_parameters() if n in self.dims}  # this stage's
        self.trainer.load_tp_shards(self.resharder.to_training(gen, self.dims))
        self._released = {}

    def released_bytes(self) -> int:
        """Training weight bytes currently freed (held only inside the generation weights)."""
        return sum(self._released.values())
