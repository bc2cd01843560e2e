"""Colocated roles: one process per device hosts every role of the group; each role keeps its own
process group and mesh, its own state, and calls reach the right role."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.worker import Worker
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

pytestmark = pytest.mark.ray


class Actor(Worker):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.steps = 0

    @register("ONE_TO_ALL")
    def pid(self):
        return os.getpid()

    @register("RANK_ZERO")
    def whoami(self):
        return type(self).__name__, self.role, self.scale

    @register("ONE_TO_ALL")
    def step(self):
        self.steps += 1
        return self.steps

    @register("ONE_TO_ALL")
    def reduce_over(self, dim: str | None):
        """Sum of (rank + 1) * scale over the role's own group (or one mesh dim)."""
        group = self.process_group if dim is None else self.mesh[dim].get_group()
        t = torch.tensor([(self.rank + 1) * self.scale])
        dist.all_reduce(t, group=group)
        return t.item()


class Critic(Actor):
    pass


@pytest.fixture(scope="module")
def colocated(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    group = WorkerGroup(ResourcePool.local(4, name="coloc"), {
        "actor": RoleSpec(Actor, ParallelConfig(dp=2, tp=2), kwargs={"scale": 1.0}),
        "critic": RoleSpec(Critic, ParallelConfig(dp=4), args=(10.0,)),
    })
    yield group
    group.shutdown()
    group.pool.remove()


def test_roles_share_one_process_per_device(colocated):
    a, c = colocated["actor"].pid(), colocated["critic"].pid()
    assert a == c and len(set(a)) == 4 and os.getpid() not in a


def test_roles_keep_separate_process_groups_and_meshes(colocated):
    a, c = colocated["actor"].worker_info(), colocated["critic"].worker_info()
    for ra, rc in zip(a, c, strict=True):
        assert ra["pid"] == rc["pid"] and ra["rank"] == rc["rank"]
        assert ra["process_group"] != rc["process_group"]
        assert not set(ra["mesh_groups"].values()) & set(rc["mesh_groups"].values())
        assert ra["process_group"] not in set(rc["mesh_groups"].values())
    assert [x["coords"] for x in a] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [x["coords"] for x in c] == [(0, r, 0) for r in range(4)]


def test_collectives_run_on_each_roles_own_groups(colocated):
    assert colocated["actor"].reduce_over(None) == [10.0] * 4
    assert colocated["critic"].reduce_over(None) == [100.0] * 4
    # actor tp groups are {0,1} and {2,3}; the critic's tp groups are single ranks
    assert colocated["actor"].reduce_over("tp") == [3.0, 3.0, 7.0, 7.0]
    assert colocated["actor"].reduce_over("dp") == [4.0, 6.0, 4.0, 6.0]
    assert colocated["critic"].reduce_over("tp") == [10.0, 20.0, 30.0, 40.0]


def test_calls_reach_the_right_role_and_state_is_separate(colocated):
    assert colocated["actor"].whoami() == ("Actor", "actor", 1.0)
    assert colocated.call("critic", "whoami") == ("Critic", "critic", 10.0)
    colocated["actor"].step()
    assert colocated["actor"].step() == [2] * 4 and colocated["critic"].step() == [1] * 4
    with pytest.raises(AttributeError, match=r"hosts roles \['actor', 'critic'\]"):
        colocated.step()
    with pytest.raises(KeyError, match="no role 'ref'"):
        colocated["ref"]
