"""A plan spanning two real Ray nodes at different addresses (ray.cluster_utils.Cluster on this
machine): each device group's workers land on the nodes the plan names, rank i on device i, the same
after a restart; each rank's collectives use the interface of its node's address; what a node cannot
see, a node short of resources, a hung call, a killed worker (restarted from the last checkpoint,
bit-exact) and a lost node are each one line naming the node."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from rl_util import tiny_plan

from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.worker import Worker
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import Device, DeviceGroup, Plan, RolePlan
from hybridflow.simulator.vocabulary.workload import Workload

pytestmark = pytest.mark.ray

TINY = ModelSpec(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)


def two_node_plan() -> Plan:
    cluster = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=2, devices_per_node=2)
    groups = [DeviceGroup(name="actor", devices=[Device(node=1, index=0), Device(node=0, index=0)]),
              DeviceGroup(name="ref", devices=[Device(node=1, index=1), Device(node=0, index=1)])]
    roles = {"actor": RolePlan(model=TINY, group="actor", train=ParallelConfig(dp=2)),
             "ref": RolePlan(model=TINY, group="ref", train=ParallelConfig(dp=2))}
    return Plan(algorithm="grpo", cluster=cluster, groups=groups, roles=roles, reward_function="m:f")


def spread_rl_plan() -> Plan:
    """GRPO on the tiny model, actor and reference in one group of two devices: node 0 and node 1."""
    w = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8, mini_batches=1)
    plan = tiny_plan("grpo", [["actor", "ref"]], [2], workload=w).model_dump()
    plan["groups"][0]["devices"] = [{"node": 0, "index": 0}, {"node": 1, "index": 0}]
    plan["cluster"].update(nodes=2, devices_per_node=2)
    return Plan.model_validate(plan)


class Where(Worker):
    @register("ONE_TO_ALL")
    def rank_sum(self):
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t, group=self.process_group)
        return t.item()

    @register("ONE_TO_ALL")
    def hang_on_rank_1(self):
        if self.rank == 1:
            time.sleep(600)  # a hung (not dead) worker
        return self.rank

    @register("ONE_TO_ALL", blocking=False)
    def wait_in_all_reduce(self):
        t = torch.ones(1)
        if self.rank == 0:
            dist.all_reduce(t, group=self.process_group)  # its peer never comes: its node goes
        else:
            time.sleep(600)
        return t.item()


def test_groups_land_on_the_planned_nodes_in_stable_rank_order(ray_two_nodes):
    import ray

    from hybridflow.runtime.controller.network import IFNAME_VARS
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, groups_from_plan

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
            ips = [n["ip"] for n in g.nodes]
            assert ips[0] != ips[1] and "127.0.0.2" in ips  # the nodes' addresses differ
            for n in g.nodes:  # each rank's collectives on the interface of its node's address
                assert n["ifnames"] == {v: interface_holding(n["ip"]) for v in IFNAME_VARS}, n
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
    from hybridflow.runtime.controller.resource_pool import ResourcePool

    pool = ResourcePool([Device(node=2, index=0)], name="far")
    with pytest.raises(HflowError, match="no Ray node has resource 'hflow_node_2'"):
        _ = pool.placement_group


def interface_holding(ip: str) -> str:
    """The interface with `ip`, or for a 127.x address the loopback one (read from psutil here)."""
    import psutil

    want = "127.0.0.1" if ip.startswith("127.") else ip
    return next(name for name, addrs in psutil.net_if_addrs().items() if any(a.address == want for a in addrs))


def test_unlabelled_nodes_are_numbered_by_address_among_those_with_the_plans_devices():
    from hybridflow.runtime.controller.nodes import plan_nodes

    def node(ip, **res):
        return {"Alive": True, "NodeID": ip, "NodeManagerAddress": ip, "Resources": {"CPU": 8.0, **res}}

    head = node("10.0.0.2")  # no GPUs: not a plan node of a GPU plan
    nodes = [head, node("10.0.0.10", GPU=8.0), node("10.0.0.9", GPU=8.0), {**node("10.0.0.3", GPU=8.0), "Alive": False}]
    assert [n["NodeID"] for n in plan_nodes(nodes, use_gpu=True).values()] == ["10.0.0.9", "10.0.0.10"]
    assert [n["NodeID"] for n in plan_nodes(nodes, use_gpu=False).values()] == ["10.0.0.2", "10.0.0.9", "10.0.0.10"]
    labelled = [node("10.0.0.7", hflow_node_1=1000.0), node("10.0.0.5", hflow_node_0=1000.0)]
    assert {i: n["NodeID"] for i, n in plan_nodes(labelled, use_gpu=False).items()} == {0: "10.0.0.5", 1: "10.0.0.7"}
    assert plan_nodes([head], use_gpu=True) == {}  # one node: every plan node folds onto it


def test_a_node_short_of_resources_is_named_with_what_it_has_and_what_the_plan_asks(ray_two_nodes):
    from hybridflow.runtime.controller.resource_pool import ResourcePool

    pool = ResourcePool([Device(node=1, index=i) for i in range(3)], name="big")
    with pytest.raises(HflowError, match=r"plan node 1 \(ip 127\.0\.0\.2, ray node \w+\) has 2 CPU; group 'big' "
                                         r"asks 3 CPU there"):
        _ = pool.placement_group


def test_the_users_interface_setting_reaches_every_worker_and_a_hung_call_is_named(ray_two_nodes, monkeypatch):
    from hybridflow.runtime.controller.calls import WorkerTimeoutError
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface_holding("127.0.0.1"))
    g = WorkerGroup(ResourcePool([Device(node=0, index=0), Device(node=1, index=0)], name="slow"),
                    {"actor": RoleSpec(Where)}, call_timeout=3.0)
    try:
        assert [n["ifnames"]["GLOO_SOCKET_IFNAME"] for n in g.nodes] == [interface_holding("127.0.0.1")] * 2
        assert g.rank_sum() == [1.0, 1.0]
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as e:  # rank 1 hangs, alive: past the call timeout the run ends
            g.hang_on_rank_1()
        assert time.monotonic() - t0 < 15
        msg = str(e.value)
        assert "past the call timeout of 3s: 'actor.hang_on_rank_1' on rank 1 of group 'slow' on node 1 (ip 127.0.0.2" in msg
        assert "rank 0" not in msg and "\n" not in msg and not g.alive
    finally:
        g.shutdown()
        g.pool.remove()


def test_folders_one_node_cannot_see_are_one_line_naming_it_before_anything_loads(ray_two_nodes, tmp_path, capsys):
    from rl_util import policy_folder

    from hybridflow.runtime.controller.storage import MARKER_PREFIX
    from hybridflow.tools.cli import main

    private = ray_two_nodes.private_dir
    if private is None:
        pytest.skip("no mount namespaces here (needs root or CAP_SYS_ADMIN) to give node 1 a folder of its own")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(spread_rl_plan().model_dump_json())
    ckpt, model = private / "ckpt", policy_folder(private / "model")
    rc = main(["run", str(plan_file), "--address", ray_two_nodes.address, "--iterations", "1", "--actor", str(model),
               "--checkpoint-dir", str(ckpt), "--metrics", str(tmp_path / "m.jsonl")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert f"--checkpoint-dir {ckpt} is not visible on node 1 (ip 127.0.0.2" in err
    assert "marker file is not there" in err and f"nor the actor's weights folder {model}" in err
    assert "shared filesystem" in err
    assert not (tmp_path / "m.jsonl").exists() and not list(ckpt.glob(f"{MARKER_PREFIX}*"))  # before iteration 1


@pytest.mark.slow
def test_a_killed_worker_restarts_from_the_last_checkpoint_and_ends_bit_exact(ray_two_nodes, tmp_path, monkeypatch):
    from hybridflow.runtime.rl.checkpoints import publish_latest
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.run_events import RunEvents
    from hybridflow.runtime.rl.trainer import Trainer

    class Phases(RunEvents):
        def __init__(self):
            self.seen = []

        def phase(self, name, text, total=None):
            self.seen.append((name, text))

    plan = spread_rl_plan()
    monkeypatch.chdir(tmp_path)  # the driver's folder; the workers run elsewhere
    events, killed = Phases(), []

    def kill_node_1_rank_after_iteration_2(m):
        if m["iteration"] == 2 and not killed:
            killed.append(t.groups["actor"].nodes[1]["pid"])
            os.kill(killed[0], signal.SIGKILL)

    # One start serves the run without the fault too: 3 iterations straight, then back to the checkpoint
    # of iteration 1 and on to 3 again with a rank killed after iteration 2 (and its checkpoint).
    t = Trainer(plan, RunConfig(cluster={"max_restarts": 1}), checkpoint_dir="ckpt", metrics_path="m.jsonl", events=events)
    try:
        t.run(3)
        want = t.fingerprints()
        publish_latest(t.checkpoint_dir, "iter_000001")
        t.resume()  # by hand: the restart must tell this run's own checkpoint (iteration 2's) from this one
        out = t.run(2, on_iteration=kill_node_1_rank_after_iteration_2)
        got = t.fingerprints()
    finally:
        t.shutdown()
    assert killed and got == want  # every rank's parameters, optimizer state and step
    assert [m["iteration"] for m in out] == [2, 3]
    # one clock across the restart: the rerun's iterations are timed by their own ops, never negative
    assert all(m["seconds"] > 0 and m["tokens_per_second"] > 0 for m in out), [m["seconds"] for m in out]
    restarts = [text for name, text in events.seen if name == "restart"]
    assert len(restarts) == 1 and "rank 1 of group 'g0' on node 1 (ip 127.0.0.2" in restarts[0], restarts
    assert "from the last checkpoint" in restarts[0]
    resumed = [text for name, text in events.seen if name == "resume"]
    assert len(resumed) == 2 and "iter_000001" in resumed[0] and "iter_000002" in resumed[1], resumed
    lines = [json.loads(x)["iteration"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3]  # each iteration once (test_rl_e2e.py: one that ran twice)
    # the relative checkpoint dir is one folder beside the driver, holding both nodes' shards
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "iter_000003"
    assert {f.name for f in (ckpt / "iter_000002" / "actor").glob("extra_rank*.pt")} == {"extra_rank0.pt",
                                                                                        "extra_rank1.pt"}
    assert len(list((ckpt / "iter_000002" / "actor" / "dcp").glob("*.distcp"))) == 2


def test_a_lost_node_is_named_with_its_ranks_not_blamed_on_a_peer(ray_two_nodes):
    """Last in this module: it takes node 1 away."""
    from hybridflow.runtime.controller.calls import WorkerDiedError
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    g = WorkerGroup(ResourcePool([Device(node=0, index=0), Device(node=1, index=0)], name="spread"),
                    {"actor": RoleSpec(Where)})
    try:
        fut = g.wait_in_all_reduce()
        time.sleep(1.0)
        ray_two_nodes.remove_node(next(iter(ray_two_nodes.worker_nodes)))
        with pytest.raises(WorkerDiedError) as e:
            fut.get(timeout=120)
        msg = str(e.value)
        assert msg.startswith("node 1 (ip 127.0.0.2") and "was lost" in msg, msg
        assert "rank 1 of group 'spread'" in msg and "rank 0" not in msg and "\n" not in msg
    finally:
        g.shutdown()
        g.pool.remove()
