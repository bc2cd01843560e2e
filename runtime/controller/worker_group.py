"""WorkerGroup: one Ray actor per device of a ResourcePool, hosting one or more role workers.

The actor (a *host*, one process per device) joins the group's torch.distributed world once;
each role it hosts (several when the plan colocates models) gets its own process group and mesh
over the same devices (see worker.py). The driver calls a role's method once; the method's
protocol (protocols.py) splits the arguments over the ranks and gathers the outputs:

    pool = ResourcePool.local(4)
    group = WorkerGroup(pool, {"actor": RoleSpec(ActorWorker, ParallelConfig(dp=2, tp=2)),
                               "ref": RoleSpec(RefWorker, ParallelConfig(dp=4))}, name="actor_ref")
    out = group["actor"].generate(batch)            # blocking (unless registered blocking=False)
    fut = group["ref"].compute_logprob.async_(out)  # a CallFuture; .get() waits
    vals = critic_group.compute_values.async_(fut)  # a future as input: resolved in the workers
    group.call("actor", "update", batch)            # the same, by name

Calls on one group run one after another (one process per device); calls on disjoint groups
overlap. A worker that dies raises WorkerDiedError and shuts down every live group (calls.py).
A run's groups start side by side: `WorkerGroup(..., start=False)` for each, then `start_together`.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.runtime.controller import worker as worker_mod
from hybridflow.runtime.controller.calls import (
    CallFuture,
    WorkerCallError,
    WorkerDiedError,
    WorkerTimeoutError,
    death_cause,
    resolve_lazy,
)
from hybridflow.runtime.controller.group_start import start_together
from hybridflow.runtime.controller.network import driver_settings, set_socket_interfaces
from hybridflow.runtime.controller.protocols import Protocol, get_protocol, method_protocol, split_call
from hybridflow.runtime.controller.resource_pool import ResourcePool
from hybridflow.runtime.controller.storage import SharedPath, describe_problems
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import Plan

_LIVE_GROUPS: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


@dataclass
class RoleSpec:
    """A role's worker class, its parallel layout (default: all devices data-parallel) and the
    arguments of its constructor."""

    cls: type
    parallel: ParallelConfig | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def ship_by_value(cls: type) -> None:
    """Worker processes import classes by module name; a class from a test file or script (not
    under `hybridflow.` and not installed) is sent by value instead, so they need not import it."""
    name = cls.__module__
    mod = sys.modules.get(name)
    file = getattr(mod, "__file__", None) or ""
    if mod is None or name == "__main__" or name.split(".")[0] == "hybridflow" or "-packages" in file:
        return
    ray.cloudpickle.register_pickle_by_value(mod)


def _failed(ref) -> bool:
    try:
        ray.get(ref, timeout=0)
    except RayTaskError:
        return True
    except Exception:
        return False
    return False


class _WorkerHost:
    """The process of one device: a torch.distributed rank hosting the role workers."""

    def __init__(self, num_threads: int):
        torch.set_num_threads(num_threads)
        self.workers: dict[str, Any] = {}
        self.place: dict = {}

    def node_info(self, ifnames: dict[str, str]) -> dict:
        """Where this process runs; sets the socket interfaces its collectives will use (network.py)."""
        ip = ray.util.get_node_ip_address()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "pid": os.getpid(),
                "ifnames": set_socket_interfaces(ip, ifnames)}

    def path_problems(self, paths: list[SharedPath]) -> list[tuple[SharedPath, str]]:
        return [(p, why) for p in paths if (why := p.problem())]

    def open_store(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Rank 0: create the group's rendezvous store on a port the OS picks, and hold it (no window
        in which another process could take the port)."""
        self.store = dist.TCPStore(ray.util.get_node_ip_address(), 0, world_size, is_master=True,
                                   timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return ray.util.get_node_ip_address(), self.store.port

    def init_dist(self, rank: int, world_size: int, addr: str, port: int, node_index: int) -> None:
        self.device, self.backend = worker_mod.device_and_backend()
        worker_mod.init_distributed(rank, world_size, addr, port, self.backend, getattr(self, "store", None))
        self.place = dict(node_index=node_index, node_id=ray.get_runtime_context().get_node_id(),
                          master_addr=addr, master_port=port)

    def add_role(self, role: str, spec: RoleSpec, parallel: ParallelConfig) -> None:
        ctx = worker_mod.build_context(role, parallel, self.device, self.backend, **self.place)
        worker_mod._building = ctx
        try:
            self.workers[role] = spec.cls(*spec.args, **spec.kwargs)
        finally:
            worker_mod._building = None

    def execute(self, role: str, method: str, args: tuple, kwargs: dict, info: dict) -> tuple[Any, dict]:
        args, kwargs, info = resolve_lazy(args, kwargs, info)
        return worker_mod.settle(getattr(self.workers[role], method)(*args, **kwargs)), info

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


_Host = ray.remote(max_restarts=0, max_concurrency=1)(_WorkerHost)


class MethodHandle:
    """`group[role].method`: call it (through its protocol) or `.async_(...)` for a future."""

    def __init__(self, group: WorkerGroup, role: str, name: str, protocol: Protocol, blocking: bool):
        self.group, self.role, self.name, self.protocol, self.blocking = group, role, name, protocol, blocking

    def __call__(self, *args, **kwargs):
        fut = self.async_(*args, **kwargs)
        return fut.get() if self.blocking else fut  # within the group's call timeout

    def async_(self, *args, **kwargs) -> CallFuture:
        return self.group.submit(self.role, self.name, self.protocol, args, kwargs)


class RoleHandle:
    """`group[role]`: attribute access gives the role's methods."""

    def __init__(self, group: WorkerGroup, role: str):
        self._group, self._role = group, role

    def __getattr__(self, name: str) -> MethodHandle:
        return self._group.method(self._role, name)


class WorkerGroup:
    """Workers of one or more colocated roles on the devices of `pool` (rank i on device i)."""

    def __init__(self, pool: ResourcePool, roles: dict[str, RoleSpec], *, name: str | None = None,
                 init_timeout_s: float = 600.0, call_timeout: float | None = None,
                 on_role: Callable[[str], None] | None = None, on_wait: Callable[[str, float], None] | None = None,
                 shared_paths: Sequence[SharedPath] = (), report_every_s: float = 30.0, start: bool = True):
        """`on_role(role)` is called as each role's workers start building (loading its weights);
        `on_wait(stage, seconds)` every `report_every_s` while a start stage (each bounded by
        `init_timeout_s`) still waits. `shared_paths` must look the same on every worker as on the
        driver (storage.py), checked before any weights load. `call_timeout`: the longest any call
        may take (None: no limit); past it the run's groups are shut down (WorkerTimeoutError).
        `start=False` only launches the processes: `start_together` then starts several groups at once."""
        if not roles:
            raise HflowError("a worker group needs at least one role, e.g. {'actor': RoleSpec(ActorWorker)}")
        self.name = name or pool.name
        self.pool = pool
        self.call_timeout = call_timeout
        self.specs = dict(roles)
        self.parallel = {r: s.parallel or ParallelConfig(dp=pool.world_size) for r, s in roles.items()}
        for role, p in self.parallel.items():
            if p.world_size != pool.world_size:
                raise HflowError(f"role '{role}': {p} uses {p.world_size} devices but pool '{pool.name}' has "
                                 f"{pool.world_size}; give a config whose pp*tp*dp equals the device count")
        self.alive = False
        self.init_timeout_s, self.on_wait, self.report_every_s = init_timeout_s, on_wait, report_every_s
        self.on_role, self.shared_paths = on_role, list(shared_paths)
        for spec in self.specs.values():
            ship_by_value(spec.cls)
        threads = max(1, int(pool.cpus_per_device))
        pg = pool.placement_group
        self.hosts = [
            _Host.options(num_cpus=pool.cpus_per_device, num_gpus=1 if pool.use_gpu else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=pg, placement_group_bundle_index=i)).remote(threads)
            for i in range(pool.world_size)
        ]
        if start:
            start_together([self])

    def _stages(self):
        """The start, as stages: each yields (refs, stage) and gets back every rank's result of it."""
        ifnames = driver_settings()
        self.nodes = yield [h.node_info.remote(ifnames) for h in self.hosts], "starting the processes"
        if self.shared_paths:
            found = yield [h.path_problems.remote(self.shared_paths) for h in self.hosts], "checking shared storage"
            for rank, problems in enumerate(found):
                if problems:
                    raise HflowError(describe_problems(problems, self.describe_node(rank)))
        world = self.pool.world_size
        (addr, port), = yield [self.hosts[0].open_store.remote(world, self.init_timeout_s)], "opening the rendezvous"
        yield ([h.init_dist.remote(r, world, addr, port, self.pool.devices[r].node) for r, h in enumerate(self.hosts)],
               "joining the process group")
        for role, spec in self.specs.items():  # same order on every rank: group creation is collective
            if self.on_role:
                self.on_role(role)
            refs = [h.add_role.remote(role, spec, self.parallel[role]) for h in self.hosts]
            try:
                yield refs, f"loading {role}'s weights"
            except RayTaskError as e:
                rank = next((r for r, ref in enumerate(refs) if _failed(ref)), 0)
                raise WorkerCallError(f"role '{role}' ({spec.cls.__name__}) failed to start on "
                                      f"{self.describe_rank(rank)}: {type(e.cause).__name__}: {e.cause}") from e.cause
        self.master = (addr, port)
        self.alive = True
        _LIVE_GROUPS.add(self)

    def _stage_timeout(self, stage: str) -> float:
        """How long a start stage may take."""
        return self.init_timeout_s

    # ---- calls ---------------------------------------------------------------------------------
    def __getitem__(self, role: str) -> RoleHandle:
        if role not in self.specs:
            raise KeyError(f"group '{self.name}' has no role '{role}' (roles: {', '.join(self.specs)})")
        return RoleHandle(self, role)

    def __getattr__(self, name: str) -> MethodHandle:
        specs = self.__dict__.get("specs")
        if name.startswith("_") or not specs:
            raise AttributeError(name)
        if len(specs) != 1:
            raise AttributeError(f"group '{self.__dict__['name']}' hosts roles {list(specs)}; "
                                 f"call group['<role>'].{name}(...)")
        return self.method(next(iter(specs)), name)

    def method(self, role: str, name: str) -> MethodHandle:
        fn = getattr(self.specs[role].cls, name, None) if role in self.specs else None
        if name.startswith("_") or not callable(fn):
            raise AttributeError(f"role '{role}' of group '{self.name}' has no method '{name}'")
        proto, blocking = method_protocol(fn)
        return MethodHandle(self, role, name, get_protocol(proto), blocking)

    def call(self, role: str, method: str, *args, **kwargs) -> Any:
        return self.method(role, method)(*args, **kwargs)

    def call_async(self, role: str, method: str, *args, **kwargs) -> CallFuture:
        return self.method(role, method).async_(*args, **kwargs)

    def submit(self, role: str, method: str, protocol: Protocol, args: tuple, kwargs: dict) -> CallFuture:
        if not self.alive:
            raise WorkerDiedError(f"group '{self.name}' is shut down; create a new WorkerGroup")
        parallel = self.parallel[role]

        def split_value(v):
            if isinstance(v, CallFuture):
                return v.lazy_parts(protocol, parallel)
            return protocol.split(v, parallel)

        per_rank, info = split_call(protocol, parallel, args, kwargs, split_value)
        refs = [h.execute.remote(role, method, a, k, info) for h, (a, k) in zip(self.hosts, per_rank, strict=True)]
        inputs = tuple(v for v in (*args, *kwargs.values()) if isinstance(v, CallFuture))
        return CallFuture(self, role, method, protocol, parallel, refs, inputs)

    # ---- placement, failure, shutdown ------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def describe_node(self, rank: int) -> str:
        n = self.nodes[rank] if rank < len(getattr(self, "nodes", [])) else {}
        return f"node {self.pool.devices[rank].node} (ip {n.get('ip', '?')}, ray node {str(n.get('node_id', '?'))[:12]})"

    def describe_rank(self, rank: int) -> str:
        n = self.nodes[rank] if rank < len(getattr(self, "nodes", [])) else {}
        return f"rank {rank} of group '{self.name}' on {self.describe_node(rank)[:-1]}, pid {n.get('pid', '?')})"

    def time_out(self, late: list[tuple[str, int, str]], seconds: float) -> WorkerTimeoutError:
        """Calls (role, rank, method) of this group ran past the call timeout: shut every group down
        (a hung rank may hold its peers in a collective) and return the error to raise."""
        named = "; ".join(f"'{role}.{method}' on {self.describe_rank(rank)}" for role, rank, method in late[:3])
        self._kill()
        others = shutdown_all()
        return WorkerTimeoutError(f"call(s) ran past the call timeout of {seconds:g}s: {named}; shut down "
                                  f"{len(others) + 1} worker group(s) (a hung worker; or raise --call-timeout)")

    def rank_on_lost_node(self) -> int | None:
        """The first rank whose Ray node is no longer alive (None: all are)."""
        dead = dead_nodes()
        return next((r for r, n in enumerate(getattr(self, "nodes", [])) if n.get("node_id") in dead), None)

    def fail(self, role: str, rank: int, method: str, err: BaseException, upstream: bool = False) -> WorkerDiedError:
        """A rank died: kill this group, shut the others down, return the error to raise. When its node
        is gone, the node is named with every rank it hosted."""
        node_id = self.nodes[rank].get("node_id") if rank < len(getattr(self, "nodes", [])) else None
        node_lost = node_id in dead_nodes()
        groups = [self, *(g for g in _LIVE_GROUPS if g is not self)]
        lost_ranks = [f"rank {r} of group '{g.name}'" for g in groups
                      for r, n in enumerate(getattr(g, "nodes", [])) if n.get("node_id") == node_id]
        self._kill()
        others = shutdown_all()
        if node_lost:
            where = self.describe_node(rank)
            return WorkerDiedError(f"{where} was lost (node down or its raylet killed), with {', '.join(lost_ranks)}; "
                                   f"during '{role}.{method}'; shut down {len(others) + 1} worker group(s)")
        n = self.nodes[rank] if rank < len(getattr(self, "nodes", [])) else {}
        here = n.get("ip") == ray.util.get_node_ip_address()  # its kernel log is this machine's
        cause = death_cause(err, n.get("pid"), here)
        what = f"lost an input from a worker that {cause}" if upstream else cause
        return WorkerDiedError(f"worker '{role}' {self.describe_rank(rank)} {what}, during '{method}'; "
                               f"shut down {len(others) + 1} worker group(s)")

    def _kill(self) -> None:
        self.alive = False
        _LIVE_GROUPS.discard(self)
        for h in self.hosts:
            ray.kill(h, no_restart=True)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Destroy the process groups, then end the processes (killed if busy past `timeout`)."""
        if not self.alive:
            return
        refs = [h.shutdown.remote() for h in self.hosts]
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
        self._kill()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, roles={list(self.specs)}, world={len(self.hosts)}, alive={self.alive})"


def groups_from_plan(plan: Plan, workers: dict[str, RoleSpec], **pool_kwargs) -> dict[str, WorkerGroup]:
    """One WorkerGroup per device group of `plan`, hosting the roles the plan colocates there, each
    with its training layout from the plan unless its RoleSpec gives one. `workers` maps every
    role of the plan to its RoleSpec; `pool_kwargs` go to ResourcePool (cpus_per_device, ...)."""
    missing = sorted(set(plan.roles) - set(workers))
    if missing:
        raise HflowError(f"no worker class for role(s) {missing}; pass a RoleSpec for every role of the plan")
    groups: dict[str, WorkerGroup] = {}
    try:
        for name, pool in ResourcePool.from_plan(plan, **pool_kwargs).items():
            roles = {r: RoleSpec(workers[r].cls, workers[r].parallel or plan.roles[r].train, workers[r].args,
                                 workers[r].kwargs) for r in plan.roles_in(name)}
            if roles:
                groups[name] = WorkerGroup(pool, roles, name=name, start=False)
    except BaseException:
        for g in groups.values():
            g._kill()
        raise
    start_together(list(groups.values()))
    return groups


def dead_nodes() -> set[str]:
    """Ray node ids the cluster has marked dead."""
    return {n["NodeID"] for n in ray.nodes() if not n["Alive"]}


def shutdown_all(timeout: float = 10.0) -> list[str]:
    """Shut down every live worker group of this driver; returns their names."""
    names = []
    for g in list(_LIVE_GROUPS):
        names.append(g.name)
        g.shutdown(timeout)
    return names
