"""The rollout interface: how a worker generates, whichever engine does it, and on whose devices.

A rollout engine runs in the plan's generation layout (tp_g, dp_g = devices / tp_g), built one of two
ways (the backend's class provides both):

- `on_trainer(trainer, ...)`: on the actor's own devices and process group, beside its training
  engine (the hybrid engine); `update_weights()` brings the trainer's current weights over before the
  first generate and after every actor update;
- `on_own_devices(...)`: on rollout devices of the actor's own (a plan's `generate_group`), with no
  trainer; the weights arrive over the weight sync (engines/rollout/weight_sync.py) through
  `load_weights`, in the whole shapes `weight_specs()` lists.

    rollout = ROLLOUT_ENGINES.get(settings.backend).on_trainer(trainer, model_path, settings, seed=0)
    rollout.update_weights()
    out = rollout.generate(prompt_ids, mask, settings.sampling, generator)   # -> Rollout
    replica, tp_rank = rollout.generation_ranks(rank)   # which prompt shard this rank generates

Backends (engines/rollout/backends.py): `native` — the 3D-HybridEngine reshard into our own generation
model on the trainer (hybrid.py), our tp-sharded model on rollout devices (native.py), the KV-cache
engine of generation.py either way; `vllm` — vLLM in this process (vllm_rollout.py). All return the
same `Rollout`. The old log-probs never come from a rollout: the actor's training engine recomputes
them (`compute_log_prob`) or its update takes its own, so every backend trains on the same quantity.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.runtime.engines.rollout.generation import Rollout, SamplingParams
from hybridflow.runtime.engines.rollout.weight_sync import TensorSpec
from hybridflow.runtime.engines.train.base import TrainEngine, exact_bytes
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import RolloutBackend


class RolloutSettings(BaseModel):
    """What a worker needs to generate: the engine, its layout and how it samples (passed whole)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: RolloutBackend = "native"
    generation: ParallelConfig | None = None  # the generation layout (pp 1); None: the worker's own
    reshard: str = "hybridflow"  # on the trainer: the 3D-HybridEngine's reshard mode (native)
    sampling: SamplingParams = SamplingParams()
    prompt_len: PositiveInt | None = None  # the longest prompt: vLLM sizes its context to it + max_new_tokens
    # the plan's engine knobs (RolePlan; vllm only): share of device memory, most sequences decoded at once
    memory_fraction: float | None = Field(None, gt=0, le=1)
    max_concurrent_sequences: PositiveInt | None = None

    @property
    def max_len(self) -> int | None:
        return self.prompt_len + self.sampling.max_new_tokens if self.prompt_len else None


class RolloutEngine(ABC):
    backend: ClassVar[RolloutBackend]

    # A registered backend's class builds its engines both ways (backends.py: ROLLOUT_ENGINES.register).
    @classmethod
    def on_trainer(cls, trainer: TrainEngine, model_path: str, settings: RolloutSettings, *,
                   seed: int) -> RolloutEngine:
        """An engine on the training engine's devices (every rank of its group builds one)."""
        raise HflowError(f"{cls.__name__} is not a rollout backend; use ROLLOUT_ENGINES.get(name)")

    @classmethod
    def on_own_devices(cls, model_path: str, settings: RolloutSettings, *, mesh: DeviceMesh, device: torch.device,
                       seed: int) -> RolloutEngine:
        """An engine on rollout devices (`mesh`: the group's ("pp", "dp", "tp") mesh) whose weights
        arrive through `load_weights`."""
        raise HflowError(f"{cls.__name__} is not a rollout backend; use ROLLOUT_ENGINES.get(name)")

    @abstractmethod
    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 lengths: torch.Tensor | None = None) -> Rollout:
        """Responses to left-padded prompts. The ranks of one generation replica pass the same prompts
        and an identically seeded generator, and all return the same rollout. `lengths` [B]: each row's
        response exactly that long, EOS not ending it (GenerationEngine.generate)."""

    @abstractmethod
    def generation_ranks(self, rank: int) -> tuple[int, int]:
        """(generation data-parallel replica, generation tensor rank) of a rank of the group."""

    def update_weights(self) -> int:
        """On the trainer: bring the generation weights up to the training engine's current ones
        (collective over the group: every rank calls it). Returns the bytes this rank received."""
        raise HflowError(f"this {self.backend} rollout runs on rollout devices; its weights come through "
                         "load_weights")

    def weight_specs(self) -> list[TensorSpec]:
        """On rollout devices: the whole tensors (HF names, shapes, dtypes) a weight sync sends."""
        raise HflowError(f"this {self.backend} rollout runs on the trainer's devices; it takes no weight sync")

    def load_weights(self, arrived: Iterable[tuple[str, torch.Tensor]]) -> int:
        """On rollout devices: whole tensors from the sync, each kept in this rank's layout; the bytes received."""
        raise HflowError(f"this {self.backend} rollout runs on the trainer's devices; it takes no weight sync")

    def record_digests(self, on: bool = True) -> None:
        """Keep, from each following sync, what `weights_digest` needs (an engine that cannot hash its
        live weights keeps the digest of what it was handed; the others need nothing)."""
        return None

    def weights_digest(self) -> str:
        """sha256 of the generation weights, whole, in the sync's names and dtypes (a collective)."""
        raise HflowError(f"the {self.backend} rollout keeps no digest of its weights")


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over names and exact bytes (the exactness check of a sync)."""
    h = hashlib.sha256()
    for name, t in named.items():
        h.update(name.encode())
        h.update(exact_bytes(t))
    return h.hexdigest()
