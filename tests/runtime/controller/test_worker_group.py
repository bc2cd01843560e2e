"""Worker groups: asynchronous calls overlap on disjoint groups and serialise on one; a future feeds
another group's call without the driver fetching it; a DTensor tensor-parallel layer across a
group gives the single-process result; worker exceptions and bad layouts give clear errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.calls import WorkerCallError
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.worker import Worker
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

pytestmark = pytest.mark.ray


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class Sleeper(Worker):
    @register("ONE_TO_ALL", blocking=False)
    def nap(self, seconds: float):
        time.sleep(seconds)
        return self.rank

    @register("DP_COMPUTE")
    def double(self, b: Batch, delay: float = 0.0) -> Batch:
        time.sleep(delay)
        return Batch({"x": b["x"] * 2}, b.non_tensors)

    @register("DP_COMPUTE")
    def boom(self, b: Batch):
        raise ValueError(f"bad input on rank {self.rank}")


class TensorParallelMLP(Worker):
    def __init__(self):
        super().__init__()
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.model = parallelize_module(mlp(), self.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

    @register("DP_COMPUTE")
    def forward(self, b: Batch) -> Batch:
        with torch.no_grad():
            y = self.model(b["x"])
        return Batch({"y": y, "shard_w": torch.full((len(b),), self.model[0].weight.to_local().shape[0])})


@pytest.fixture(scope="module")
def groups(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup, start_together
    from hybridflow.simulator.vocabulary.plan import Device

    left = WorkerGroup(ResourcePool([Device(node=0, index=i) for i in (0, 1)], name="left"),
                       {"sleeper": RoleSpec(Sleeper), "tp": RoleSpec(TensorParallelMLP, ParallelConfig(tp=2))},
                       start=False)
    right = WorkerGroup(ResourcePool([Device(node=0, index=i) for i in (2, 3)], name="right"),
                        {"sleeper": RoleSpec(Sleeper)}, start=False)
    start_together([left, right])
    yield left, right
    for g in (left, right):
        g.shutdown()
        g.pool.remove()


def test_disjoint_groups_overlap_one_group_serialises(groups):
    left, right = groups
    left["sleeper"].nap(0.0).get(), right.nap(0.0).get()  # warm
    t0 = time.monotonic()
    a, b = left["sleeper"].nap(1.0), right.nap(1.0)  # registered blocking=False: futures
    assert a.get() == [0, 1] and b.get() == [0, 1]
    together = time.monotonic() - t0
    t0 = time.monotonic()
    a, b = left["sleeper"].nap(1.0), left["sleeper"].nap(1.0)
    a.get(), b.get()
    serial = time.monotonic() - t0
    assert together < 1.5, together
    assert serial >= 2.0, serial


def test_future_feeds_another_groups_call_inside_the_workers(groups):
    left, right = groups
    b = Batch({"x": torch.arange(5.0)}, non_tensors={"id": list("abcde")})
    t0 = time.monotonic()
    first = left["sleeper"].double.async_(b, delay=1.0)
    second = right.double.async_(first)  # the driver does not wait for `first`
    submitted = time.monotonic() - t0
    assert submitted < 0.5 and first._result is None
    out = second.get()
    assert torch.equal(out["x"], torch.arange(5.0) * 4) and out["id"].tolist() == list("abcde")


def test_tensor_parallel_layer_matches_single_process(groups):
    left, _ = groups
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = mlp()(x)
    out = left["tp"].forward(Batch({"x": x}))
    assert out["shard_w"].tolist() == [8] * 6  # each rank holds half of the first layer's rows
    torch.testing.assert_close(out["y"], expected, rtol=1e-5, atol=1e-6)


def test_worker_exception_names_rank_and_cause(groups):
    left, _ = groups
    with pytest.raises(WorkerCallError, match=r"'sleeper.boom' failed on rank \d of group 'left' on node 0 .*"
                                              r"ValueError: bad input on rank \d"):
        left["sleeper"].boom(Batch({"x": torch.ones(2)}))
    assert left["sleeper"].double(Batch({"x": torch.ones(3)}))["x"].tolist() == [2.0] * 3  # still usable


def test_layout_must_match_the_pool(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    with pytest.raises(HflowError, match="uses 4 devices but pool 'two' has 2"):
        WorkerGroup(ResourcePool.local(2, name="two"), {"a": RoleSpec(Sleeper, ParallelConfig(tp=4))})


class BadInit(Worker):
    def __init__(self, path: str):
        super().__init__()
        raise FileNotFoundError(f"no weights at {path}")


def test_worker_that_fails_to_start_names_role_rank_and_cause(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    pool = ResourcePool.local(1, name="bad")
    with pytest.raises(WorkerCallError, match=r"role 'critic' \(BadInit\) failed to start on rank 0 of group 'bad' "
                                              r".*FileNotFoundError: no weights at /nowhere"):
        WorkerGroup(pool, {"critic": RoleSpec(BadInit, args=("/nowhere",))})
    pool.remove()


class MeetsTheOtherGroup(Worker):
    """Builds only while the other group builds too: leaves its mark, then waits for the other's."""

    def __init__(self, marks: str, me: str, other: str, fail: bool = False):
        super().__init__()
        Path(marks, me).touch()
        deadline = time.monotonic() + 120
        while not Path(marks, other).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"group '{other}' did not build while '{me}' did")
            time.sleep(0.05)
        if fail:
            raise ValueError("no weights")


def test_groups_started_together_build_at_once_and_one_failing_ends_them_all(ray_local, tmp_path):
    from ray.exceptions import RayActorError

    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup, start_together

    def group(me, other, fail=False):
        return WorkerGroup(ResourcePool.local(1, name=me),
                           {"x": RoleSpec(MeetsTheOtherGroup, args=(str(tmp_path), me, other, fail))}, start=False)

    a, b = group("a", "b"), group("b", "a", fail=True)
    try:
        with pytest.raises(WorkerCallError, match=r"role 'x' \(MeetsTheOtherGroup\) failed to start on rank 0 of group "
                                                  r"'b' .*ValueError: no weights"):
            start_together([a, b])
        assert not a.alive and not b.alive
        # group a built, and was ended with b; ray.kill goes by way of Ray's control store while a call
        # goes straight to the process, so one call may still be served before the kill arrives
        deadline = time.monotonic() + 60
        with pytest.raises(RayActorError):
            while time.monotonic() < deadline:
                ray_local.get(a.hosts[0].node_info.remote({}), timeout=60)
                time.sleep(0.2)
    finally:
        a.pool.remove()
        b.pool.remove()


def test_bundles_are_gpus_when_the_cluster_has_them_else_virtual_devices(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool

    assert ResourcePool.local(2).bundles() == [{"CPU": 1.0}] * 2  # this cluster has no GPUs
    assert ResourcePool.local(2, use_gpu=True, cpus_per_device=4).bundles() == [{"CPU": 4, "GPU": 1.0}] * 2


def test_multi_node_plan_folds_onto_a_single_node_cluster(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.simulator.vocabulary.plan import Device

    pool = ResourcePool([Device(node=3, index=0), Device(node=1, index=2)], name="far")
    assert pool.bundles() == [{"CPU": 1.0}] * 2  # no node pin: one local node takes every plan node
