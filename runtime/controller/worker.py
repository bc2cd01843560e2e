"""Worker: the base class of everything that runs on a device of a worker group.

A WorkerGroup starts one process per device (a Ray actor, the "host"), joins those processes
into one torch.distributed world (NCCL on GPUs, gloo on CPU; master = rank 0's node), then
creates each role's worker in every process. Each role gets its own process group and its own
device mesh over the same devices, with dims ("pp", "dp", "tp"), tp fastest, matching
`ParallelConfig.rank_coords`; so two colocated roles never share a communicator.

A worker subclass is plain torch code — no Ray in it — and wraps an engine:

    class CriticWorker(Worker):
        def __init__(self, model_path):
            super().__init__()                         # rank, mesh, device, ... now set
            self.engine = FsdpEngine(model_path, mesh=self.mesh)

        @register("DP_COMPUTE")
        def compute_values(self, batch: Batch) -> Batch:
            return self.engine.values(batch)           # runs on this rank's dp shard

Use `self.mesh["tp"]`, `self.process_group`, `self.device`; never the default process group
(colocated roles share it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.runtime.controller.protocols import register
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

MESH_DIMS = ("pp", "dp", "tp")


@dataclass
class WorkerContext:
    """Where a role's worker runs: set by the host process before the worker is built."""

    role: str
    rank: int
    world_size: int
    parallel: ParallelConfig
    backend: str
    device: torch.device
    process_group: dist.ProcessGroup
    mesh: DeviceMesh
    node_index: int  # the plan's node of this rank's device
    node_id: str  # the Ray node it landed on
    master_addr: str
    master_port: int


_building: WorkerContext | None = None  # the context of the worker being constructed


def device_and_backend() -> tuple[torch.device, str]:
    """cuda + NCCL (and gloo for CPU tensors) when this process sees a GPU, else cpu + gloo."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # Ray shows each actor only its own GPU
        return torch.device("cuda", 0), "cpu:gloo,cuda:nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                     store: dist.Store | None = None) -> None:
    """Join this process into its group's world (once per process, shared by colocated roles). The
    rendezvous is `store` on rank 0 (the TCPStore it created and holds, so its port was never free
    for another process to take) and a client of it on the others."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if store is None:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def build_context(role: str, parallel: ParallelConfig, device: torch.device, backend: str,
                  node_index: int, node_id: str, master_addr: str, master_port: int) -> WorkerContext:
    """A role's own process group and ("pp", "dp", "tp") mesh. Every rank must call this for the
    same roles in the same order (process-group creation is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if parallel.world_size != world:
        raise ValueError(f"role '{role}': {parallel} needs {parallel.world_size} devices, the group has {world}")
    pg = dist.new_group(ranks=list(range(world)), group_desc=f"{role}_world")
    dim_backend = "nccl" if device.type == "cuda" else "gloo"
    # An explicit backend makes DeviceMesh create new groups even for a dim spanning the whole
    # world (it would otherwise reuse the default group, shared by all colocated roles).
    mesh = DeviceMesh(device.type, torch.arange(world).view(parallel.pp, parallel.dp, parallel.tp),
                      mesh_dim_names=MESH_DIMS, backend_override=((dim_backend, None),) * len(MESH_DIMS))
    return WorkerContext(role, rank, world, parallel, backend, device, pg, mesh, node_index, node_id,
                         master_addr, master_port)


def settle(value):
    """Wait for collectives still in flight in an output (a DTensor layer's local output is an
    AsyncCollectiveTensor, whose buffer is not final until waited) before it leaves the process."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from hybridflow.runtime.controller.batch import Batch

    if isinstance(value, AsyncCollectiveTensor):
        return value.wait()
    if isinstance(value, Batch):
        for k, v in list(value.tensors.items()):
            if isinstance(v, AsyncCollectiveTensor):
                value.tensors[k] = v.wait()
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(settle(v) for v in value)
    if isinstance(value, dict):
        return {k: settle(v) for k, v in value.items()}
    return value


class Worker:
    """Base class of role workers; construct only through a WorkerGroup."""

    def __init__(self):
        if _building is None:
            raise RuntimeError(f"{type(self).__name__} must be created by a WorkerGroup (it needs a rank and "
                               "a process group); to use its engine alone, build the engine directly")
        self.ctx: WorkerContext = _building

    @property
    def role(self) -> str:
        return self.ctx.role

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def parallel(self) -> ParallelConfig:
        return self.ctx.parallel

    @property
    def coords(self) -> tuple[int, int, int]:
        """(pp, dp, tp) of this rank."""
        return self.parallel.rank_coords(self.rank)

    @property
    def mesh(self) -> DeviceMesh:
        return self.ctx.mesh

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.ctx.process_group

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @register("ONE_TO_ALL")
    def worker_info(self) -> dict:
        """Where this rank runs (for tests, logs and the failure message)."""
        return {"role": self.role, "rank": self.rank, "coords": self.coords, "pid": os.getpid(),
                "node_index": self.ctx.node_index, "node_id": self.ctx.node_id, "device": str(self.device),
                "backend": self.ctx.backend, "process_group": self.process_group.group_name,
                "mesh_groups": {d: self.mesh[d].get_group().group_name for d in MESH_DIMS}}
