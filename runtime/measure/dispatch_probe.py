"""How long the single controller takes between two dependent calls: the dispatch gap.

In a run, an op starts some milliseconds after the op it depends on has ended on its worker: the
result travels back through Ray, the driver unpacks it, shards the next call's batch and submits
it, and the workers unpack their shards. No FLOP or byte term of the cost model holds that time.
This probe measures it with the runtime's own parts — a WorkerGroup on local devices, a
DP_COMPUTE method, Batches of a rollout's shape — in the pattern of the RLHF loops: two calls
sent together (as `gather` sends its log-prob calls), then both awaited, and the next pair made
from the result. Two worker-timed gaps come out: "dependent", from the end of the call an input
came from to the start of the call that takes it, and "queued", from the end of one call to the
start of the next call that was already waiting on the same group.

    dependent, queued = measure_dispatch(devices=2, batch=16, seq_len=24, calls=20)  # ProfilePoints
"""

from __future__ import annotations

import statistics
import time

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.worker import Worker
from hybridflow.simulator.calibration.profile import ProfilePoint


class EchoWorker(Worker):
    """Returns its shard as it came, with the worker-side start and end of the call."""

    @register("DP_COMPUTE")
    def echo(self, batch: Batch) -> Batch:
        start = time.time()
        out = Batch(batch.tensors.clone())
        out.meta["timing"] = {"echo": [start, time.time()]}
        return out


def measure_dispatch(devices: int, batch: int = 16, seq_len: int = 24, calls: int = 20
                     ) -> tuple[ProfilePoint, ProfilePoint]:
    """Median worker-timed (dependent, queued) gaps between calls on a group of `devices` local devices."""
    import ray

    from hybridflow.runtime.controller.resource_pool import ResourcePool, init_ray
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    owns = not ray.is_initialized()
    init_ray(num_cpus=devices)
    pool = ResourcePool.local(devices, name="dispatch-probe")
    group = WorkerGroup(pool, {"echo": RoleSpec(EchoWorker)}, name="dispatch-probe")
    try:
        ids = torch.randint(4, 64, (batch, seq_len), generator=torch.Generator().manual_seed(0))
        data = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                      "position_ids": torch.arange(seq_len).expand(batch, seq_len).clone()})
        dependent, queued, last_end = [], [], None
        for i in range(calls + 2):  # the first two pairs warm the path up
            first = group.call_async("echo", "echo", data)
            second = group.call_async("echo", "echo", data)
            a, data = first.get(), second.get()
            (a_start, a_end), (b_start, b_end) = a.meta.pop("timing")["echo"], data.meta.pop("timing")["echo"]
            if i >= 2:
                dependent.append(a_start - last_end)
                queued.append(b_start - a_end)
            last_end = b_end
    finally:
        group.shutdown()
        pool.remove()
        if owns:
            ray.shutdown()

    def point(gaps, mode):
        return ProfilePoint(op="dispatch", mode=mode, batch=batch, prompt_len=seq_len, group_size=devices,
                            seconds=max(statistics.median(gaps), 1e-6), std=statistics.pstdev(gaps), repeats=len(gaps))

    return point(dependent, "dependent"), point(queued, "queued")
