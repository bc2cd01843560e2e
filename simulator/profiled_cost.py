"""ProfiledCostModel: the analytic CostModel plus the engines' fixed overheads a profile measures.

The analytic model prices FLOPs, bytes and collectives. On small shapes — tiny models, CPU
devices, eager PyTorch — a large share of an op's time is fixed work per layer and per call:
dispatching a layer's dozen kernels (forward, and about twice that in the backward), the extra
DTensor dispatch of a tensor-parallel layer, setting up a call and an optimizer step. These do not
scale with FLOPs or bytes, so no efficiency term of the analytic model can absorb them. A profile
fits them; their defaults are 0, which leaves the analytic model exactly as it is.

The overheads are added as one more part of each OpCost's breakdown ("overhead"), so tables still
add up. Method signatures are CostModel's: the planner and the schedule use this class unchanged.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .cost import CostModel, OpCost
from .efficiency import EfficiencyParams
from .hardware import ClusterSpec
from .memory import decode_batch
from .model import Head, ModelSpec
from .parallel import ParallelConfig
from .workload import Workload

BF16 = 2


class EngineOverheads(BaseModel):
    """Fixed seconds the engines spend beyond FLOPs, bytes and collectives (fitted to a profile)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer_seconds: float = Field(0.0, ge=0, description="per decoder layer per forward pass of one micro-batch "
                                 "(or one decode step): eager kernel dispatch; a backward counts twice")
    tp_layer_seconds: float = Field(0.0, ge=0, description="extra per layer per pass when tp > 1: DTensor "
                                    "dispatch and the synchronisation of the layer's two collectives")
    dp_layer_seconds: float = Field(0.0, ge=0, description="extra per layer per pass when dp > 1: the FSDP "
                                    "unshard / reshard hooks around the layer's weight all-gather")
    reshard_layer_seconds: float = Field(0.0, ge=0, description="per layer of a reshard that moves data: one "
                                         "gather per parameter tensor, each with its own setup")
    call_seconds: float = Field(0.0, ge=0, description="per op call on a device: batching, gathering results")
    step_seconds: float = Field(0.0, ge=0, description="per optimizer step: zeroing, clipping, the step's launch")


def _micro_batches(sequences: int, steps: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches one rank runs: as CostModel._passes splits the work."""
    per_rank = max(1, -(-sequences // (steps * dp)))
    b = min(micro_batch_size, per_rank)
    return steps * -(-per_rank // b)


class ProfiledCostModel(CostModel):
    def __init__(self, cluster: ClusterSpec, params: EfficiencyParams | None = None,
                 overheads: EngineOverheads | None = None):
        super().__init__(cluster, params)
        self.overheads = overheads or EngineOverheads()

    def _layer(self, par: ParallelConfig, fsdp: bool = True) -> float:
        o = self.overheads
        return (o.layer_seconds + (o.tp_layer_seconds if par.tp > 1 else 0.0)
                + (o.dp_layer_seconds if fsdp and par.dp > 1 else 0.0))

    @staticmethod
    def _with(cost: OpCost, extra: float) -> OpCost:
        if extra <= 0.0:
            return cost
        parts = dict(cost.breakdown)
        parts["overhead"] = parts.get("overhead", 0.0) + extra
        return OpCost.model_construct(seconds=cost.seconds + extra, flops=cost.flops, bytes=cost.bytes,
                                      breakdown=parts)

    def forward(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
                sequences: int | None = None) -> OpCost:
        cost = super().forward(model, head, parallel, workload, sequences)
        seqs = workload.sequences if sequences is None else sequences
        micro = _micro_batches(seqs, 1, parallel.dp, workload.micro_batch_size)
        extra = micro * model.layers / parallel.pp * self._layer(parallel) + self.overheads.call_seconds
        return self._with(cost, extra)

    def train(self, model: ModelSpec, head: Head, parallel: ParallelConfig, workload: Workload,
              recompute: bool = False) -> OpCost:
        cost = super().train(model, head, parallel, workload, recompute)
        steps = workload.ppo_epochs * workload.mini_batches
        micro = _micro_batches(workload.sequences * workload.ppo_epochs, steps, parallel.dp,
                               workload.micro_batch_size)
        passes = 4.0 if recompute else 3.0
        extra = (passes * micro * model.layers / parallel.pp * self._layer(parallel)
                 + steps * self.overheads.step_seconds + self.overheads.call_seconds)
        return self._with(cost, extra)

    def generate(self, model: ModelSpec, gen: ParallelConfig, workload: Workload, sequences: int | None = None,
                 free_bytes_per_device: float | None = None) -> OpCost:
        cost = super().generate(model, gen, workload, sequences, free_bytes_per_device)
        seqs = workload.sequences if sequences is None else sequences
        if free_bytes_per_device is None:
            free_bytes_per_device = self.usable_bytes - BF16 * model.num_params("lm") / (gen.tp * gen.pp)
        batch = max(1, decode_batch(model, gen, workload, free_bytes_per_device, self.params, seqs))
        per_replica = -(-seqs // gen.dp)
        waves = -(-per_replica // batch)
        passes = waves * workload.response_len  # the prefill and response_len - 1 decode steps
        # generation replicas hold whole (tp-sharded) weights: no FSDP hooks however large dp is
        extra = passes * model.layers * self._layer(gen, fsdp=False) + self.overheads.call_seconds
        return self._with(cost, extra)

    def reshard(self, model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, mode: str) -> OpCost:
        cost = super().reshard(model, train, gen, mode)
        moves = cost.bytes > 0
        return self._with(cost, model.layers * self.overheads.reshard_layer_seconds if moves else 0.0)
