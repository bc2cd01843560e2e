"""Weight sync: the actor's trained weights to separate rollout devices, over one collective group
that spans both worker groups.

Each WorkerGroup is its own torch.distributed world, so a process cannot join a second world
through `init_process_group`. The sync group is built beside it, the way verl and OpenRLHF build
theirs: a TCPStore at the sender (rank 0 of the actor's group) and a process group constructed
directly on it — gloo on CPU, NCCL on GPUs. Its ranks: 0 the sender, 1 + r rank r of the rollout
group.

    group = WeightSyncGroup(addr, port, rank, world)            # every member, at the same time
    nbytes = group.broadcast(layout, tensors)                   # sender: the whole model, bucketed
    for name, t in group.broadcast(layout):                     # receivers: the same buckets back
        ...

Bucketed: parameters are packed in the layout's order into flat buffers of one dtype and at most
`bucket_bytes` each (a larger parameter gets a bucket of its own), one broadcast per bucket. The
buckets carry exactly the parameters' bytes, no padding: every receiving rank gets the model's
bytes M, so one sync moves M × (rollout ranks) over the group.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from hybridflow.simulator.vocabulary.execution import (
    WEIGHT_SYNC_BUCKET_BYTES as DEFAULT_BUCKET_BYTES,  # the buckets it prices
)


class TensorSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def tensor_specs(named: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The whole (unsharded) shape and dtype of each named tensor, in order."""
    return [TensorSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch.")) for n, t in named.items()]


def buckets(specs: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[TensorSpec]]:
    """Consecutive runs of one dtype of at most `bucket_bytes` (a larger tensor alone in its bucket)."""
    out: list[list[TensorSpec]] = []
    size = 0
    for s in specs:
        if out and out[-1][0].dtype == s.dtype and size + s.nbytes <= bucket_bytes:
            out[-1].append(s)
            size += s.nbytes
        else:
            out.append([s])
            size = s.nbytes
    return out


def master_store(host: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """The sync group's store, on a port the OS picks and held from then on: no window in which
    another process could take the port between choosing and binding it."""
    return dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class WeightSyncGroup:
    """A process group over the sender (rank 0) and the rollout ranks, outside both groups' worlds."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0,
                 store: dist.TCPStore | None = None):
        """`store`: rank 0's, from `master_store` (held since before the port was handed out); the
        other ranks connect to it at `addr`:`port`."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = store if store is not None else dist.TCPStore(addr, port, world_size, False, timeout=timeout)
        prefixed = dist.PrefixStore("hflow_weight_sync", self.store)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()

    def send(self, specs: list[TensorSpec], tensors: Mapping[str, torch.Tensor],
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Sender: broadcast `tensors` (whole, named as in `specs`, cast to the spec's dtype). Returns the
        bytes each receiver gets."""
        sent = 0
        for bucket in buckets(specs, bucket_bytes):
            flat = torch.cat([tensors[s.name].detach().to(self.device, s.torch_dtype).reshape(-1) for s in bucket])
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, specs: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Receiver: the tensors of `specs`, bucket by bucket as they arrive (views into the bucket)."""
        for bucket in buckets(specs, bucket_bytes):
            flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].torch_dtype, device=self.device)
            self._broadcast(flat)
            for s, part in zip(bucket, flat.split([s.numel for s in bucket]), strict=True):
                yield s.name, part.view(s.shape)

    def close(self) -> None:
        self.pg = None
        self.store = None
