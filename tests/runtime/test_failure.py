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
        assert "worker 'actor' rank 1 of group 'victim' on node 0" in msg and "died during 'wait_in_all_reduce'" in msg
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
