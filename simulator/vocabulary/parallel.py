"""ParallelConfig: how one model is split over its devices (pipeline × tensor × data, and for a MoE model
trained by megatron-core, expert parallelism: each MoE layer's experts split over `ep` of the dp ranks,
which hold the rest of the model as before; for long sequences, Ulysses sequence parallelism: each
sequence's tokens split over `sp` consecutive dp ranks, which exchange attention heads by all-to-all, so
dp/sp groups of sp ranks take different sequences — pp·tp·(dp/sp)·sp = the devices).

Data parallelism in training is fully sharded (FSDP / ZeRO-3: weights, gradients and optimizer
states are split over dp), which is what the runtime runs. Rank order is (pp, dp, tp) with tp
fastest, so a tensor-parallel group is consecutive devices and stays inside a node.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec

TrainBackend = Literal["fsdp", "megatron"]  # the training engines this runtime runs (and the planner searches)
TRAIN_BACKENDS: tuple[str, ...] = get_args(TrainBackend)
# ... and one it prices for the systems it is compared with: DeepSpeed ZeRO-3 training Hugging Face models, as
# DeepSpeed-Chat and OpenRLHF run it (FSDP's traffic, its own fitted efficiency; not runnable here).
PricedBackend = Literal["fsdp", "megatron", "deepspeed"]


class ParallelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pp: PositiveInt = 1
    tp: PositiveInt = 1
    dp: PositiveInt = 1
    # The training engine of a train config: FSDP2 + DTensor TP, or megatron-core (runtime/engines/
    # engines/train/megatron/engine.py: its distributed optimizer, 1F1B pipeline). Generation configs leave it.
    backend: PricedBackend = "fsdp"
    ep: PositiveInt = 1  # expert-parallel size (megatron only); not a factor of world_size
    # dp ranks per sequence, not a factor of world_size: Ulysses sequence parallelism on fsdp, context
    # parallelism (ring attention) on megatron (priced; this runtime does not run it: execution.py)
    sp: PositiveInt = 1

    @model_validator(mode="after")
    def _experts_on_megatron(self):
        if self.ep > 1 and self.backend != "megatron":
            raise ValueError(f"ep={self.ep}: expert parallelism runs on the megatron backend (FSDP keeps every "
                             "expert on each rank); set backend: megatron or ep: 1")
        if self.sp > 1 and self.backend == "deepspeed":
            raise ValueError(f"sp={self.sp}: sequence parallelism is priced for the fsdp (Ulysses) and megatron "
                             "(context parallelism) backends; set one of them or sp: 1")
        if self.dp % self.sp:
            raise ValueError(f"sp={self.sp} must divide dp={self.dp} (each sequence is split over sp of the dp ranks)")
        return self

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def generation_layout(self) -> ParallelConfig:
        """The same (pp, tp, dp) as a generation config (which names no training engine nor splits sequences)."""
        if self.backend == "fsdp" and self.sp == 1:
            return self
        return self.model_copy(update={"backend": "fsdp", "ep": 1, "sp": 1})

    @property
    def model_parallel_size(self) -> int:
        return self.pp * self.tp

    def label(self) -> str:
        return (f"{self.pp}-{self.tp}-{self.dp}" + (f"-ep{self.ep}" if self.ep > 1 else "")
                + (f"-sp{self.sp}" if self.sp > 1 else ""))

    def __str__(self) -> str:
        return (f"pp{self.pp}·tp{self.tp}·dp{self.dp}" + (f"·ep{self.ep}" if self.ep > 1 else "")
                + (f"·sp{self.sp}" if self.sp > 1 else ""))

    def problems(self, model: ModelSpec, devices_per_node: int | None = None) -> list[str]:
        out = []
        if model.heads % self.tp or model.kv_heads % self.tp:
            out.append(f"tp={self.tp} must divide heads={model.heads} and kv_heads={model.kv_heads}")
        elif self.sp > 1 and self.backend == "fsdp" and (model.heads % (self.tp * self.sp)
                              or (model.kv_heads % (self.tp * self.sp) and (self.tp * self.sp) % model.kv_heads)):
            out.append(f"sp·tp={self.sp * self.tp} must divide heads={model.heads} (and divide or be a multiple of "
                       f"kv_heads={model.kv_heads}): Ulysses gives each rank whole heads")
        if model.layers % self.pp:
            out.append(f"pp={self.pp} must divide layers={model.layers}")
        if self.ep > 1 and (model.experts is None or model.experts % self.ep or self.dp % self.ep):
            out.append(f"ep={self.ep} must divide the experts ({model.experts or 'none: a dense model'}) and "
                       f"dp={self.dp}")
        if devices_per_node is not None and self.tp > devices_per_node:
            out.append(f"tp={self.tp} exceeds {devices_per_node} devices per node (tensor parallelism stays inside a node)")
        return out

    def validate_for(self, model: ModelSpec, devices_per_node: int | None = None) -> ParallelConfig:
        bad = self.problems(model, devices_per_node)
        if bad:
            raise HflowError(f"parallel config {self} does not fit {model.name}: {'; '.join(bad)}")
        return self

    def rank_coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of a rank; tp varies fastest."""
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return pp, dp, tp
