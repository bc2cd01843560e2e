"""Run a function on N local gloo processes (torch.multiprocessing); collect each rank's result.

Cheap and independent of Ray: engine tests, benchmarks and the profiler need only a
torch.distributed group of "virtual devices" on one machine (or the GPUs of one). Each child uses one thread, a fresh free port, and returns its
result (or its traceback) through a queue.
"""

from __future__ import annotations

import importlib.util
import io
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# Imported once in the forkserver, which every group of a session shares (the first run_local
# starts it with its preload list): megatron.core takes seconds to import, so where it is
# installed it is preloaded too, rather than imported again by each rank of a megatron group.
ENGINE_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.fsdp",
                  "hybridflow.runtime.controller.tensordict_import", "hybridflow.runtime.engines.train.fsdp.engine",
                  "hybridflow.runtime.engines.rollout.reshard", "hybridflow.runtime.engines.rollout.generation",
                  "hybridflow.runtime.models.decoder"]
MEGATRON_PRELOAD = ["hybridflow.runtime.engines.train.megatron.preload", "hybridflow.runtime.engines.train.megatron.engine"]
PRELOAD = ENGINE_PRELOAD + (MEGATRON_PRELOAD if _installed("megatron.core") else [])


_PROGRESS: list = [None]  # the queue rank 0 reports progress on (set in _child)


def report_progress(done: int) -> None:
    """From inside `fn` on rank 0: `done` steps finished (run_local's `on_progress` hears it)."""
    if _PROGRESS[0] is not None:
        _PROGRESS[0].put((-1, "progress", done))


def _child(rank, world_size, port, fn, args, queue):
    _PROGRESS[0] = queue if rank == 0 else None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # one core's worth per virtual device, as the Ray workers run
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Nobody leaves before everyone is done: a rank still setting up a group (new_group) with
        # one that has exited fails with "Broken pipe".
        dist.barrier()
        # Plain bytes: tensors sent through a torch queue live in shared memory owned by the sender,
        # which is gone by the time the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn, world_size: int, *args, timeout: float = 240.0, preload: list[str] | None = None,
              on_progress=None, daemon: bool = True) -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` processes of one group (gloo on CPU, NCCL
    on GPUs); return results by rank.

    `fn` must be importable (a module-level function) and its result picklable. A failure on
    any rank raises RuntimeError with that rank's traceback. `on_progress(done)` is called here
    whenever rank 0 calls `report_progress`. `daemon=False` lets `fn` start processes of its own
    (megatron's dist_checkpointing writes through forked writers); they are still killed on failure.
    """
    # forkserver: a clean server process (no Ray/grpc threads of the test session to fork) that
    # imports torch and the engines once; each child is then a cheap fork of it.
    ctx = mp.get_context(os.environ.get("HFLOW_START_METHOD", "forkserver"))
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD if preload is None else preload)
    queue = ctx.SimpleQueue()
    # The parent holds the rendezvous on a port the kernel picked and never let go of: a port found
    # free and handed to rank 0 to bind later can be taken meanwhile (EADDRINUSE).
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue), daemon=daemon)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.02)
            continue
        rank, ok, out = queue.get()
        if ok == "progress":
            if on_progress is not None:
                on_progress(out)
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(out), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{out}")
            break  # the others may be stuck in a collective with the failed rank
    for p in procs:
        p.join(timeout=1 if errors or len(results) < world_size else 30)
        if p.is_alive():
            p.kill()
    del store
    if errors:
        raise RuntimeError("distributed run failed on " + "\n".join(errors))
    if len(results) < world_size:
        why = f"timed out after {timeout:.0f}s" if time.monotonic() > deadline else "exited without a result (see stderr)"
        raise RuntimeError(f"distributed run: only ranks {sorted(results)} of {world_size} finished; the rest {why}")
    return [results[r] for r in range(world_size)]
