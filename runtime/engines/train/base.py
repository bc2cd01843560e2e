"""The training-engine interface: what FSDP2 (fsdp/) and megatron-core (megatron/) engines both are, the
part of a step they share, and the registry that picks one by the train config's `backend`.

An engine owns one model sharded by a ParallelConfig, its optimizer and the bookkeeping of a step. It
knows nothing of RL or Ray: a loss function plugs in,

    loss_fn(outputs, micro) -> loss | (loss, {name: float})

and workers wrap it. What is written once here:
- the learning-rate schedule (a linear warm-up, `OptimConfig.warmup_steps`);
- the end of a step: metrics averaged over the data-parallel ranks, and the skipped-step guard (a step
  whose gradient norm or loss is not finite, on any rank, is skipped; `max_skipped_steps` in a row stop
  the run with one line);
- checkpoint hooks: the engine writes its sharded model and optimizer states (`_save_shards`), this
  writes each rank's optimizer step and random-number states beside them (rank_state.py), so a resumed
  run draws what a straight one would, and refuses a folder of another layout before reading it;
- the fingerprint of a rank's parameters and optimizer states that resume checks compare.

    engine = build_train_engine(model, parallel, optim=OptimConfig(lr=1e-5), micro_batch_size=4)
    metrics = engine.train_step(batch, loss_fn, token_weights="response_mask")
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.controller.tensordict_import import TensorDict
from hybridflow.runtime.engines.phase_clock import PhaseClock
from hybridflow.runtime.engines.registry import Registry
from hybridflow.runtime.engines.train.optim import OptimConfig
from hybridflow.runtime.engines.train.rank_state import (
    check_checkpoint_folder,
    load_rank_state,
    save_rank_state,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

LossFn = Callable[[dict, TensorDict], "torch.Tensor | tuple[torch.Tensor, dict[str, float]]"]


def as_tensordict(batch: Mapping[str, torch.Tensor] | TensorDict) -> TensorDict:
    if isinstance(batch, TensorDict):
        return batch
    if hasattr(batch, "tensors") and isinstance(batch.tensors, TensorDict):  # runtime.controller.batch.Batch
        return batch.tensors
    n = next(iter(batch.values())).shape[0]
    return TensorDict(dict(batch), batch_size=[n])


def exact_bytes(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes, read from a CPU copy (never a numpy view of live, possibly device,
    storage) as raw bytes: numpy has no bfloat16, and a 0-d tensor (an optimizer's step) has no byte view."""
    return t.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class TrainEngine(ABC):
    """A model sharded as `parallel` says, with its optimizer. Subclasses build `model` and `optimizer`
    and implement the passes; `_apply_step` is their part of a step's end."""

    backend: ClassVar[str]  # the train config's `backend` that selects it
    shards_folder: ClassVar[str]  # where `_save_shards` puts the sharded states inside a checkpoint folder

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, parallel: ParallelConfig | None, optim: OptimConfig | None, micro_batch_size: int | None,
                 temperature: float):
        if temperature <= 0:
            raise HflowError(f"temperature {temperature}: log-probs need a positive temperature")
        self.parallel = parallel or ParallelConfig()
        self.optim_config = optim or OptimConfig()
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.step = 0  # optimizer steps taken (skipped ones not counted)
        self.skipped_in_a_row = 0
        self.clock = PhaseClock()  # per-phase seconds for the step breakdown; off unless a caller turns it on
        self.distributed = False  # set by an engine whose model is sharded over a process group

    # ---- what every engine implements ----------------------------------------------------------
    @abstractmethod
    def compute_log_probs(self, batch, micro_batch_size: int | None = None, entropy: bool = False,
                          score_width: int | None = None) -> TensorDict:
        """Token log-probs (and entropy) of the local batch, no gradient: [B, S] fields aligned with
        input_ids (`score_width`: only the last columns are read; an engine may leave the others 0)."""

    @abstractmethod
    def compute_values(self, batch, micro_batch_size: int | None = None) -> TensorDict:
        """Per-token values of a scalar-head model: {"values": [B, S]}."""

    @abstractmethod
    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int | None = None, *,
                   token_weights: str | None = None, entropy: bool = True,
                   score_width: int | None = None) -> dict[str, float]:
        """One optimizer step on the local batch; metrics averaged over micro-batches and dp ranks."""

    @abstractmethod
    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Whole weights in HF names on CPU (a collective; `rank0_only`: the others get {})."""

    @abstractmethod
    def tp_shard_dims(self) -> dict[str, int | None]:
        """For each parameter (HF name), the dimension split over tensor parallelism (None: replicated)."""

    @abstractmethod
    def gathered_tp_shards(self) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """This rank's tensor-parallel shard of every parameter (whole over dp), valid inside the `with`."""

    @abstractmethod
    def load_tp_shards(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Put this rank's tensor-parallel shards back into the training weights."""

    @abstractmethod
    def release_weights(self, held_elsewhere: set[str]) -> dict[str, int]:
        """Free the training weights' storage while the generation weights hold them (the hybrid
        engine's zero-redundancy switch); `held_elsewhere`: the parameters the generation weights
        hold a slice of. Returns what `restore_weights` needs."""

    @abstractmethod
    def restore_weights(self, freed: dict[str, int]) -> None:
        """Reallocate what release_weights freed; the weights then arrive through load_tp_shards."""

    @abstractmethod
    def _dp_group(self):
        """The process group of this rank's data-parallel peers (None: no data parallelism here)."""

    @abstractmethod
    def _apply_step(self, skip: bool) -> float:
        """Clip the gradients and step the optimizer, unless `skip` (a loss was not finite) or the
        gradient norm is not finite; returns the gradient norm before clipping."""

    @abstractmethod
    def _save_shards(self, path: Location) -> None: ...

    @abstractmethod
    def _load_shards(self, path: Location) -> None: ...

    # ---- the learning-rate schedule --------------------------------------------------------------
    def learning_rate(self) -> float:
        """This step's learning rate: linear warm-up over `warmup_steps`, then the config's schedule
        (constant, or linear / cosine decay: OptimConfig.lr_at)."""
        return self.optim_config.lr_at(self.step)

    def _set_lr(self) -> float:
        lr = self.learning_rate()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    # ---- the end of a step ------------------------------------------------------------------------
    def _dp_mean(self, values: list[float]) -> list[float]:
        """Average floats over the data-parallel ranks (tensor-parallel ranks already agree)."""
        group = self._dp_group()
        if group is None or self.parallel.dp == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return (t / self.parallel.dp).tolist()

    def _finish_step(self, sums: dict[str, float]) -> dict[str, float]:
        """The optimizer step at this step's learning rate, or a skipped step where the gradient norm (the
        same on every rank) or a loss on any rank is not finite; the metrics averaged over dp."""
        sums = {"nonfinite_loss": 0.0, **sums}
        keys = list(sums)
        metrics = dict(zip(keys, self._dp_mean([sums[k] for k in keys]), strict=True))
        nonfinite_loss = metrics.pop("nonfinite_loss") > 0
        lr = self._set_lr()
        grad_norm = self._apply_step(nonfinite_loss)
        skip = nonfinite_loss or not math.isfinite(grad_norm)
        if skip:
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= self.optim_config.max_skipped_steps:
                raise HflowError(f"{self.skipped_in_a_row} optimizer steps in a row had a non-finite gradient or loss "
                                 f"(after step {self.step}); lower the learning rate or check the rewards")
        else:
            self.step += 1
            self.skipped_in_a_row = 0
        metrics.update(grad_norm=grad_norm, lr=lr, step=self.step, skipped=float(skip))
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    def save(self, path: str | Path | Location) -> Location:
        """The sharded model and optimizer states and this rank's step and RNG states, in a local folder
        or at a URL (returns once every rank's part is written)."""
        path = Location(path)
        self._save_shards(path)
        save_rank_state(path, self.rank, self.step)
        if self.distributed:
            dist.barrier()
        return path

    def load(self, path: str | Path | Location) -> None:
        path = Location(path)
        check_checkpoint_folder(path, self.rank, self.shards_folder, f"{type(self).__name__}.save")
        self._load_shards(path)
        self.step = load_rank_state(path, self.rank)

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers holding the states: the optimizer itself, or those a wrapper chains."""
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [getattr(o, "optimizer", o) for o in chained]

    def fingerprint(self) -> str:
        """sha256 over this rank's parameters and optimizer state (exact bytes): resume checks compare it."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            if not isinstance(p, torch.Tensor):  # megatron's `_extra_state` entries
                continue
            h.update(name.encode())
            h.update(exact_bytes(p.to_local() if hasattr(p, "to_local") else p))
        for i, optimizer in enumerate(self._torch_optimizers()):
            for pid, st in sorted(optimizer.state_dict()["state"].items()):
                for k, v in sorted(st.items()):
                    if isinstance(v, torch.Tensor):
                        v = v.to_local() if hasattr(v, "to_local") else v
                        h.update(f"{i}.{pid}.{k}".encode() if i else f"{pid}.{k}".encode())
                        h.update(exact_bytes(v))
        h.update(str(self.step).encode())
        return h.hexdigest()


# ---- the registry ---------------------------------------------------------------------------------

TRAIN_ENGINES = Registry("training backend", {"fsdp": "hybridflow.runtime.engines.train.fsdp.engine",
                                              "megatron": "hybridflow.runtime.engines.train.megatron.engine"})


def build_train_engine(model: torch.nn.Module, parallel: ParallelConfig | None, *, optim: OptimConfig | None = None,
                       micro_batch_size: int | None = None, temperature: float = 1.0, lora=None,
                       lora_seed: int = 0, micro_batch_tokens: int | None = None) -> TrainEngine:
    """The engine of `parallel.backend` (FSDP2 without a config) for `model`; `lora` (a LoraConfig): train
    adapters on the frozen model (the FSDP engine only: megatron-core 0.16 has no LoRA of its own);
    `micro_batch_tokens`: sequence packing's token budget (the FSDP engine only, fsdp/packed.py)."""
    backend = parallel.backend if parallel is not None else "fsdp"
    extra = {}
    if lora is not None:
        if backend != "fsdp":
            raise HflowError(f"LoRA trains on the fsdp backend only (megatron-core 0.16 has no LoRA of its own); "
                             f"set train.backend: fsdp, not {backend}")
        extra = {"lora": lora, "lora_seed": lora_seed}
    if micro_batch_tokens is not None:
        if backend != "fsdp":
            raise HflowError(f"sequence packing (micro_batch_tokens) runs on the fsdp backend, not {backend}; "
                             "drop the token budget or set train.backend: fsdp")
        extra["micro_batch_tokens"] = micro_batch_tokens
    return TRAIN_ENGINES.get(backend)(model, parallel, optim=optim, micro_batch_size=micro_batch_size,
                                       temperature=temperature, **extra)

