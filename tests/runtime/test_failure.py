"""A worker killed mid-call: the driver gets one clear WorkerDiedError (role, rank, node) within a
bounded time although the other rank is blocked in a collective with it; every group is shut down."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from hybridflow.runtime.calls import WorkerDiedError, get_all
from hybridflow.runtime.protocols import register
from hybridflow.runtime.worker import Worker

pytestmark = pytest.mark.ray


class Stuck(Worker):
    @register("ONE_TO_ALL")
    def pid(self):
        return os.getpid()

    @register("RANK_ZERO")
    def echo(self, value):
        return value

    @register("ONE_TO_ALL", blocking=False)
    def wait_in_all_reduce(self):
        """Rank 0 dawdles; the others wait for it inside a gloo all-reduce (which would hang for
        gloo's 30-minute timeout if nobody noticed the death)."""
        if self.rank == 0:
            time.sleep(60)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.process_group)
        return t.item()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_worker_gives_clear_error_quickly_and_shuts_everything_down(ray_local):
    from hybridflow.runtime.resource_pool import ResourcePool
    from hybridflow.runtime.worker_group import RoleSpec, WorkerGroup

    victim = WorkerGroup(ResourcePool.local(2, name="victim"), {"actor": RoleSpec(Stuck)})
    bystander = WorkerGroup(ResourcePool.local(1, name="bystander"), {"critic": RoleSpec(Stuck)})
    try:
        pids = victim.pid()
        fut = victim.wait_in_all_reduce()
        downstream = bystander.echo.async_(fut)  # waits, inside the bystander, for the victim's result
        time.sleep(1.0)  # both ranks are inside the call now
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as err:
            get_all([downstream, fut], timeout=60)
        elapsed = time.monotonic() - t0
        msg = str(err.value)
        assert "worker 'actor' rank 1 of group 'victim' on node 0" in msg and "during 'wait_in_all_reduce'" in msg
        assert "exited with no error of its own" in msg and "out-of-memory killer" in msg and "\n" not in msg
        assert f"pid {pids[1]}" in msg and "shut down 2 worker group(s)" in msg
        assert elapsed < 20, elapsed
        assert not victim.alive and not bystander.alive
        with pytest.raises(WorkerDiedError, match="group 'bystander' is shut down"):
            bystander.pid()
        deadline = time.monotonic() + 20
        while not _gone(pids[0]) and time.monotonic() < deadline:  # the rank stuck in the collective is ended too
            time.sleep(0.2)
        assert _gone(pids[0])
    finally:
        for g in (victim, bystander):
            g.shutdown()
            g.pool.remove()


def test_death_cause_names_memory_when_ray_killed_the_worker_for_it():
    from ray.exceptions import ActorDiedError, OutOfMemoryError

    from hybridflow.runtime.calls import death_cause

    # the memory monitor's text (Ray's docs, "Out-of-Memory Prevention")
    oom = OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.2, "
                           "ID: 3a4b) where the task was running was 32.53GB / 33.28GB (0.977449), which exceeds the "
                           "memory usage threshold of 0.95. Ray killed this worker (ID: 39416a) because it was the "
                           "most recently scheduled task.")
    cause = death_cause(oom)
    assert "ran out of memory (32.53GB / 33.28GB used" in cause and "fewer devices per node" in cause
    assert "\n" not in cause
    assert death_cause(ActorDiedError()).startswith("died (The actor died unexpectedly")
