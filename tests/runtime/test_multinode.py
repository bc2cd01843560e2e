"""A plan spanning two real Ray nodes (ray.cluster_utils.Cluster on this machine): each device
group's workers land on the nodes the plan names, rank i on device i, the same after a restart."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridflow.runtime.protocols import register
from hybridflow.runtime.worker import Worker
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.model import ModelSpec
from hybridflow.simulator.parallel import ParallelConfig
from hybridflow.simulator.plan import Device, DeviceGroup, Plan, RolePlan

pytestmark = pytest.mark.ray

TINY = ModelSpec(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)


def two_node_plan() -> Plan:
    cluster = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=2, devices_per_node=2)
    groups = [DeviceGroup(name="actor", devices=[Device(node=1, index=0), Device(node=0, index=0)]),
              DeviceGroup(name="ref", devices=[Device(node=1, index=1), Device(node=0, index=1)])]
    roles = {"actor": RolePlan(model=TINY, group="actor", train=ParallelConfig(dp=2)),
             "ref": RolePlan(model=TINY, group="ref", train=ParallelConfig(dp=2))}
    return Plan(algorithm="grpo", cluster=cluster, groups=groups, roles=roles, reward_function="m:f")


class Where(Worker):
    @register("ONE_TO_ALL")
    def rank_sum(self):
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=self.process_group)
        return t.item()


def test_groups_land_on_the_planned_nodes_in_stable_rank_order(ray_two_nodes):
    import ray

    from hybridflow.runtime.resource_pool import ResourcePool
    from hybridflow.runtime.worker_group import RoleSpec, groups_from_plan

    node_of_label = {k: n["NodeID"] for n in ray.nodes() if n["Alive"] for k in n["Resources"]
                     if k.startswith("hflow_node_")}
    assert len(set(node_of_label.values())) == 2
    plan = two_node_plan()
    expected = {g.name: [node_of_label[f"hflow_node_{d.node}"] for d in g.devices] for g in plan.groups}
    groups = groups_from_plan(plan, {"actor": RoleSpec(Where), "ref": RoleSpec(Where)})
    try:
        assert {name: g.pool.bundle_node_ids() for name, g in groups.items()} == expected
        for name, g in groups.items():
            info = g.worker_info()
            assert [i["node_id"] for i in info] == expected[name], name
            assert [i["node_index"] for i in info] == [d.node for d in plan.group(name).devices]
            assert g.rank_sum() == [1.0, 1.0]  # one gloo world spanning both nodes
            assert list(g.specs) == [name] and g.parallel[name] == plan.roles[name].train
    finally:
        for g in groups.values():
            g.shutdown()
            g.pool.remove()
    # a restart reserves the same nodes for the same ranks (placement is what fixes a rank's node)
    pools = ResourcePool.from_plan(plan)
    try:
        assert {name: p.bundle_node_ids() for name, p in pools.items()} == expected
    finally:
        for p in pools.values():
            p.remove()


def test_plan_naming_a_node_the_cluster_lacks_is_a_one_line_error(ray_two_nodes):
    from hybridflow.runtime.resource_pool import ResourcePool

    pool = ResourcePool([Device(node=2, index=0)], name="far")
    with pytest.raises(HflowError, match="no Ray node has resource 'hflow_node_2'"):
        _ = pool.placement_group
