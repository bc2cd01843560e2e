"""ResourcePool: the Ray placement group behind one device group of a Plan.

One bundle per device, in the order the plan lists the devices, so bundle i hosts rank i.
With GPUs in the cluster a bundle is `{"GPU": 1, "CPU": c}`; without, it is a *virtual device*
`{"CPU": c}` — one process with its share of the cores — so the same plan runs on a laptop.

Which Ray node is the plan's node i is nodes.py's rule (a `hflow_node_<i>` label, else the i-th smallest
IP, else the one node). Each bundle asks a sliver of its node's resource, so ranks never move to
another node.

    init_ray()                                           # local; init_ray("auto") joins a cluster
    pools = ResourcePool.from_plan(plan)                 # {group name: pool}
    pool = ResourcePool.local(4)                         # 4 devices on node 0, for tests
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from hybridflow.runtime.controller.kill_evidence import fold_ray_notices
from hybridflow.runtime.controller.nodes import LABEL_HINT, by_label, node_label, plan_nodes
from hybridflow.runtime.controller.ray_reaper import reap_with_driver
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Device, DeviceGroup, Plan

_PIN = 0.001  # the sliver of a node resource one bundle asks for


def init_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
             resources: dict | None = None, quiet: bool = True) -> None:
    """Start a new local Ray (default) or join the cluster at `address` ("auto", "ray://..", "ip:port").

    No address means a cluster of our own even when another `ray start` cluster runs on this machine
    (plain ray.init() would attach to that one)."""
    if ray.is_initialized():
        return
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a stale token file must not block local runs
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources) if address is None else {}
    for attempt in range(3):  # a loaded machine can miss Ray's fixed 30 s raylet start window
        try:
            ray.init(address=address or "local", include_dashboard=False, ignore_reinit_error=True,
                     logging_level=logging.WARNING if quiet else logging.INFO, **kwargs)
            fold_ray_notices()  # a lost worker is our one line, not ours and Ray's
            if address is None:
                reap_with_driver()  # its processes end with this driver, even a SIGKILLed one
            return
        except Exception as e:
            ray.shutdown()
            if attempt == 2 or address is not None or "timed out during startup" not in str(e):
                raise


def node_pins(wanted: set[int], use_gpu: bool = False) -> dict[int, str]:
    """Plan node index -> the Ray resource that pins a bundle to that node ({} = no pinning)."""
    nodes = plan_nodes(ray.nodes(), use_gpu)
    if not nodes:
        return {}
    labelled = by_label(nodes)
    missing = sorted(i for i in wanted if i not in nodes)
    if missing and labelled:
        raise HflowError(f"the plan uses node(s) {missing} but no Ray node has resource "
                         f"'{node_label(missing[0])}'; start that node with "
                         f"--resources='{{\"{node_label(missing[0])}\": 1000}}'")
    if missing:
        kind = "GPUs" if use_gpu else "CPUs"
        raise HflowError(f"the plan uses node {missing[0]} but the Ray cluster has {len(nodes)} node(s) with {kind}; "
                         f"add nodes or plan for fewer (nodes are numbered by address; label them with {LABEL_HINT} "
                         "to choose)")
    return {i: node_label(i) if labelled else f"node:{nodes[i]['NodeManagerAddress']}" for i in wanted}


def describe_node(index: int, node: dict) -> str:
    return f"plan node {index} (ip {node['NodeManagerAddress']}, ray node {node['NodeID'][:12]})"


class ResourcePool:
    """The devices of one device group, reserved as a Ray placement group (bundle i = rank i)."""

    def __init__(self, devices: DeviceGroup | list[Device], *, name: str | None = None,
                 cpus_per_device: float = 1.0, use_gpu: bool | None = None, timeout_s: float = 60.0):
        if isinstance(devices, DeviceGroup):
            name = name or devices.name
            devices = devices.devices
        if not devices:
            raise HflowError(f"resource pool '{name}' has no devices; give the group at least one")
        self.name = name or "pool"
        self.devices: list[Device] = list(devices)
        self.cpus_per_device = cpus_per_device
        self._use_gpu = use_gpu
        self.timeout_s = timeout_s
        self._pg: PlacementGroup | None = None

    @classmethod
    def local(cls, n: int, name: str = "local", **kwargs) -> ResourcePool:
        return cls([Device(node=0, index=i) for i in range(n)], name=name, **kwargs)

    @classmethod
    def from_plan(cls, plan: Plan, **kwargs) -> dict[str, ResourcePool]:
        """One pool per device group that some role (or the actor's generation) uses."""
        used = {rp.group for rp in plan.roles.values()} | {rp.generate_group for rp in plan.roles.values()}
        return {g.name: cls(g, **kwargs) for g in plan.groups if g.name in used}

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def use_gpu(self) -> bool:
        if self._use_gpu is None:
            self._use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return self._use_gpu

    def bundles(self) -> list[dict[str, float]]:
        pins = node_pins({d.node for d in self.devices}, self.use_gpu)
        out = []
        for d in self.devices:
            b = {"CPU": self.cpus_per_device, **({"GPU": 1.0} if self.use_gpu else {})}
            if d.node in pins:
                b[pins[d.node]] = _PIN
            out.append(b)
        return out

    def asks(self) -> dict[int, dict[str, float]]:
        """Plan node -> the CPUs (and GPUs) this pool's bundles ask of it."""
        out: dict[int, dict[str, float]] = {}
        for d in self.devices:
            ask = out.setdefault(d.node, {"CPU": 0.0, **({"GPU": 0.0} if self.use_gpu else {})})
            ask["CPU"] += self.cpus_per_device
            if self.use_gpu:
                ask["GPU"] += 1.0
        return out

    def short_nodes(self, free: bool) -> list[str]:
        """The plan nodes that lack what this pool asks of them: their total resources (free: what is
        unreserved now, from Ray's per-node view), one phrase each."""
        nodes = plan_nodes(ray.nodes(), self.use_gpu)
        out = []
        for index, ask in sorted(self.asks().items()):
            node = nodes.get(index)
            if node is None:
                continue  # a single-node cluster: the cluster-wide figure says it
            have = node_free(node["NodeID"]) if free else node["Resources"]
            if not have:
                continue  # this Ray cannot tell a node's free resources
            if any(have.get(k, 0.0) + 1e-9 < v for k, v in ask.items()):
                what = ", ".join(f"{have.get(k, 0.0):g} {k}" for k in ask)
                asked = ", ".join(f"{v:g} {k}" for k, v in ask.items())
                out.append(f"{describe_node(index, node)} has {what}{' free' if free else ''}; "
                           f"group '{self.name}' asks {asked} there")
        return out

    @property
    def placement_group(self) -> PlacementGroup:
        """Reserve the bundles (once) and wait until Ray has placed them all (at most `timeout_s`)."""
        if self._pg is None:
            bundles = self.bundles()
            short = self.short_nodes(free=False)
            if short:
                raise HflowError(f"{short[0]}; start that node with more CPUs/GPUs, lower cpus_per_device or "
                                 "plan fewer devices on it")
            pg = placement_group(bundles, strategy="PACK", name=f"hflow_{self.name}_{os.getpid()}_{id(self)}")
            try:
                ray.get(pg.ready(), timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)
                short = self.short_nodes(free=True)
                have = {k: v for k, v in ray.available_resources().items() if not k.startswith(("node:", "memory",
                                                                                               "object_store"))}
                where = short[0] if short else f"free in the cluster: {have}"
                raise HflowError(f"resource pool '{self.name}' needs {len(bundles)} bundles like {bundles[0]} but Ray "
                                 f"could not place them in {self.timeout_s:.0f}s ({where}); free them (another run?), "
                                 "start Ray with more CPUs/GPUs or lower cpus_per_device") from None
            self._pg = pg
        return self._pg

    def bundle_node_ids(self) -> list[str]:
        """The Ray node id of each bundle, in rank order."""
        table = ray.util.placement_group_table(self.placement_group)
        return [table["bundles_to_node_id"][i] for i in range(self.world_size)]

    def remove(self) -> None:
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __repr__(self) -> str:
        devs = ", ".join(f"{d.node}:{d.index}" for d in self.devices)
        return f"ResourcePool({self.name!r}, devices=[{devs}], {'GPU' if self._use_gpu else 'CPU'})"


def node_free(node_id: str) -> dict[str, float]:
    """The unreserved resources of one Ray node ({} where this Ray cannot tell)."""
    try:
        from ray._private.state import state  # no public per-node view of free resources

        return dict(state.available_resources_per_node().get(node_id, {}))
    except Exception:  # a Ray without it: the cluster-wide figure is reported instead
        return {}


def place_pool(pool: ResourcePool) -> str:
    """Reserve `pool`'s devices now; a line saying where and how long it took."""
    t0 = time.monotonic()
    _ = pool.placement_group
    nodes = sorted({d.node for d in pool.devices})
    return (f"placed group '{pool.name}' ({pool.world_size} device(s) on plan node(s) "
            f"{', '.join(map(str, nodes))}) in {time.monotonic() - t0:.1f} s")
