"""A worker killed mid-call: the driver gets one clear WorkerDiedError (role, rank, node) within a
bounded time although the other rank is blocked in a collective with it; every group is shut down."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from hybridflow.runtime.controller.calls import WorkerDiedError, get_all
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.worker import Worker

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
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup, start_together

    victim = WorkerGroup(ResourcePool.local(2, name="victim"), {"actor": RoleSpec(Stuck)}, start=False)
    bystander = WorkerGroup(ResourcePool.local(1, name="bystander"), {"critic": RoleSpec(Stuck)}, start=False)
    start_together([victim, bystander])
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
        assert "was killed by a signal" in msg and "\n" not in msg  # no OOM record for it: stated as a signal
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

    from hybridflow.runtime.controller.calls import death_cause

    # the memory monitor's text (Ray's docs, "Out-of-Memory Prevention")
    oom = OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.2, "
                           "ID: 3a4b) where the task was running was 32.53GB / 33.28GB (0.977449), which exceeds the "
                           "memory usage threshold of 0.95. Ray killed this worker (ID: 39416a) because it was the "
                           "most recently scheduled task.")
    cause = death_cause(oom)
    assert "ran out of memory (32.53GB / 33.28GB used" in cause and "fewer devices per node" in cause
    assert "\n" not in cause
    assert death_cause(ActorDiedError()).startswith("died (The actor died unexpectedly")


class SlowStart(Worker):
    def __init__(self):
        super().__init__()
        time.sleep(60)  # a model load that takes too long


@pytest.mark.slow
def test_a_start_past_the_start_timeout_names_the_stage_and_reports_while_it_waits(ray_local):
    from hybridflow.runtime.controller.calls import WorkerTimeoutError
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    class ShortWeightsStage(WorkerGroup):
        """The start timeout, short for the weights stage only: the test then waits 8 s for it, while
        the process start takes what it takes on a busy machine (each stage is bounded alike)."""

        def _stage_timeout(self, stage):
            return 8.0 if stage.startswith("loading") else 120.0

    heard, weights_from = [], []
    pool = ResourcePool.local(1, name="slowstart")
    try:
        with pytest.raises(WorkerTimeoutError) as e:
            ShortWeightsStage(pool, {"actor": RoleSpec(SlowStart)}, init_timeout_s=120.0, report_every_s=2.0,
                              on_role=lambda role: weights_from.append(time.monotonic()),
                              on_wait=lambda stage, s: heard.append((stage, round(s))))
        waited = time.monotonic() - weights_from[0]
    finally:
        pool.remove()
    assert 8 <= waited < 20, waited  # the stage ended at its timeout, not when the load would have
    msg = str(e.value)
    assert msg.startswith("group 'slowstart': loading actor's weights took over 8s (still waiting: rank 0 of group "
                          "'slowstart' on node 0") and "raise --start-timeout" in msg, msg
    weights = [s for stage, s in heard if stage == "loading actor's weights"]
    assert weights and weights == sorted(weights) and weights[0] >= 2 and len(weights) <= 4, heard


@pytest.mark.slow
def test_run_with_a_call_past_call_timeout_is_exit_3_naming_the_call(ray_local, tmp_path, capsys):
    from rl_util import tiny_plan

    from hybridflow.simulator import Workload
    from hybridflow.tools.cli import main

    w = Workload(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=8, micro_batch_size=8, mini_batches=1)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan("grpo", [["actor", "ref"]], workload=w).model_dump_json())
    rc = main(["run", str(plan_file), "--iterations", "1", "--call-timeout", "0.001", "--metrics",
               str(tmp_path / "m.jsonl")])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "\n" not in err, err
    assert "ran past the call timeout of 0.001s: 'actor." in err and "on rank 0 of group 'g0' on node 0 (ip" in err
    assert not (tmp_path / "m.jsonl").exists()
