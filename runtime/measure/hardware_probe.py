"""Describe this machine as a cluster of devices in seconds: matmul FLOP/s, memory bandwidth and the
gloo (or NCCL) all-reduce bandwidth and latency between its device processes — cached on disk.

On a CPU box each "device" is one process with one thread (how the runtime's Ray workers run), so
the figures are per process: one core's GEMM rate, one core's copy bandwidth, the all-reduce
between two processes. Bandwidths are given per bf16-equivalent byte (the cost model counts 2
bytes per element; the CPU engines move fp32, 4), i.e. half the physical figure on CPU.

    hw = probe_hardware()                 # HardwareSpec, cached under ~/.cache/hybridflow
    cluster = local_cluster()             # ClusterSpec: 1 node × devices (default: the cores)
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

from hybridflow.runtime.controller.host import cache_dir, cache_share, cpu_count, cpu_name, memory_total
from hybridflow.runtime.measure.process_group import local_device, run_group
from hybridflow.simulator.calibration.profile import Fingerprint, ProfilePoint
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, HardwareSpec
from hybridflow.simulator.vocabulary.units import BF16, GiB, MiB

MATMUL_N = 512
COPY_BYTES = 32 * MiB
SMALL, LARGE = 4, 4 * MiB  # all-reduce sizes for the latency and the bandwidth


def default_devices() -> int:
    """GPUs when there are, else one virtual device per core (at least 2, so collectives exist)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else max(2, cpu_count())


def fingerprint(devices: int | None = None) -> Fingerprint:
    cuda = torch.cuda.is_available()
    return Fingerprint(
        hostname=platform.node(), platform=platform.platform(), processor=platform.machine(), cpu_count=cpu_count(),
        device_kind="cuda" if cuda else "cpu", device_name=torch.cuda.get_device_name(0) if cuda else cpu_name(),
        devices=devices or default_devices(), torch_version=torch.__version__, dtype="bfloat16" if cuda else "float32",
        cache_bytes=0 if cuda else cache_share(),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def memory_bytes() -> float:
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return memory_total() or 8.0 * GiB


# ---- the measurements (run inside the process group) ------------------------------------------
def _times(fn, repeats: int) -> list[float]:
    """Seconds of `fn` over `repeats` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _median(fn, repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


def _best(fn, repeats: int) -> float:
    """The least seconds: what the device does when nothing else runs on its core for those milliseconds.
    A median over a few milliseconds catches whatever else the machine did then (the calling process
    starting up, a logger thread) and read 2x slow from run to run."""
    return min(_times(fn, repeats))


def probe_rank(rank: int, world: int, repeats: int) -> dict:
    dev = local_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = MATMUL_N * (8 if dev.type == "cuda" else 1)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    # every rank computes at once: what each virtual device gets when they all work
    dist.barrier()
    mm = _best(lambda: torch.mm(a, b), 4 * repeats)
    src = torch.ones(COPY_BYTES // 4, device=dev)
    dst = torch.empty_like(src)
    dist.barrier()
    cp = _best(lambda: dst.copy_(src), 4 * repeats)
    small, large = torch.ones(SMALL // 4, device=dev), torch.ones(LARGE // 4, device=dev)

    def allreduce(t):
        def run():
            dist.barrier()
            dist.all_reduce(t)
        return run

    lat_barrier = _median(dist.barrier, repeats)
    lat = max(_median(allreduce(small), repeats) - lat_barrier, 1e-7)
    big = max(_median(allreduce(large), repeats) - lat_barrier, 1e-7)
    return {"matmul_n": n, "matmul_s": mm, "copy_s": cp, "allreduce_small_s": lat, "allreduce_large_s": big,
            "elem_bytes": src.element_size()}


def probe_points(raw: dict, world: int) -> list[ProfilePoint]:
    """The probe's raw figures as profile points (op kinds matmul and memory; its all-reduces, timed
    net of a barrier, only set the spec's link figures — the grid measures collectives as they run)."""
    return [
        ProfilePoint(op="matmul", size_bytes=raw["matmul_n"], seconds=raw["matmul_s"], flops=2.0 * raw["matmul_n"] ** 3),
        ProfilePoint(op="memory", size_bytes=COPY_BYTES, seconds=raw["copy_s"], bytes=2.0 * COPY_BYTES),
    ]


def spec_from_probe(raw: dict, world: int, name: str | None = None) -> HardwareSpec:
    per_elem = BF16 / raw["elem_bytes"]  # bytes per bf16-equivalent byte (module docstring)
    flops = 2.0 * raw["matmul_n"] ** 3 / raw["matmul_s"]
    copy_bw = 2.0 * COPY_BYTES / raw["copy_s"] * per_elem  # read + write
    lat = raw["allreduce_small_s"]
    ring = 2.0 * (world - 1) / world * LARGE
    # One device has no link to measure (and runs no collective): any positive figure will do.
    link_bw = ring / max(raw["allreduce_large_s"] - lat, 1e-9) * per_elem if world > 1 else copy_bw
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return HardwareSpec(
        name=name or (f"{kind}-{cpu_count()}core" if kind == "cpu" else torch.cuda.get_device_name(0).lower()),
        peak_flops=flops, hbm_bandwidth=copy_bw, hbm_bytes=memory_bytes() / (world if kind == "cpu" else 1),
        intra_node_bandwidth=link_bw, inter_node_bandwidth=link_bw, intra_node_latency=lat, inter_node_latency=lat,
        host_bandwidth=copy_bw,
        source=f"measured by hflow-plan's hardware probe on {cpu_name() if kind == 'cpu' else kind} "
               f"({world} processes, {raw['elem_bytes'] * 8}-bit); bandwidths per bf16-equivalent byte")


def run_probe(devices: int | None = None, repeats: int = 5) -> tuple[HardwareSpec, list[ProfilePoint]]:
    """Measure now (a few seconds): the HardwareSpec and the raw points."""
    world = devices or default_devices()
    raws = run_group(probe_rank, world, repeats, timeout=300)
    # the slowest rank sets the pace of a synchronous group
    raw = {k: max(r[k] for r in raws) if k.endswith("_s") else raws[0][k] for k in raws[0]}
    return spec_from_probe(raw, world), probe_points(raw, world)


MAX_AGE_S = 30 * 24 * 3600  # a cached probe older than this is measured again
DISAGREE = 2.0  # a quick check this many times faster or slower than the cache: measured again
BUSY_LOAD = 0.5  # load average per core above which the machine counts as busy while probing


def quick_matmul_flops(repeats: int = 5) -> float:
    """One thread's matmul rate now (a few tens of ms): the check a cached probe must agree with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a device process runs one thread (module docstring)
    try:
        n = MATMUL_N
        a, b = torch.randn(n, n), torch.randn(n, n)
        return 2.0 * n ** 3 / _best(lambda: torch.mm(a, b), 4 * repeats)
    finally:
        torch.set_num_threads(threads)


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    import os

    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, cores: int) -> str | None:
    if load is None or load <= BUSY_LOAD * cores:
        return None
    return (f"the machine was busy while it was measured (load average {load:.1f} on {cores} cores): predictions "
            "may be off; run again with --reprobe when it is quiet")


def probe_hardware(devices: int | None = None, *, refresh: bool = False,
                   notes: list[str] | None = None) -> HardwareSpec:
    """This machine's HardwareSpec for `devices` device processes, measured and cached with when it was
    measured and how busy the machine was. The cache is measured again when `refresh`, when older than
    MAX_AGE_S, or when a quick matmul now disagrees with it by more than DISAGREE×; `notes` gets a line
    for each of those and for a probe taken on a busy machine."""
    notes = notes if notes is not None else []
    world = devices or default_devices()
    fp = fingerprint(world)
    key = hashlib.sha256(json.dumps([fp.device_kind, fp.device_name, fp.cpu_count, world, fp.torch_version])
                         .encode()).hexdigest()[:16]
    path = cache_dir() / f"hardware-{key}.json"
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            hw = HardwareSpec.model_validate(data.get("spec", data))
            age = time.time() - data.get("measured_at", 0.0)  # an older cache carries no date: stale
            now = quick_matmul_flops() if fp.device_kind == "cpu" else hw.peak_flops
            ratio = now / hw.peak_flops
            if age > MAX_AGE_S:
                notes.append(f"the cached hardware probe is {age / 86400:.0f} days old (or undated): measuring again")
            elif not 1 / DISAGREE <= ratio <= DISAGREE:
                notes.append(f"the cached hardware probe ({hw.peak_flops / 1e9:.1f} GFLOP/s) disagrees with a quick "
                             f"check now ({now / 1e9:.1f} GFLOP/s): measuring again")
            else:
                if note := busy_note(data.get("load_average"), fp.cpu_count):
                    notes.append(note)
                return hw
        except ValueError:
            pass
    load = load_average()
    hw, _ = run_probe(world)
    from hybridflow.simulator.io import write_atomic

    if note := busy_note(load, fp.cpu_count):
        notes.append(note)
    try:
        write_atomic(path, json.dumps({"spec": hw.model_dump(mode="json"), "measured_at": time.time(),
                                       "load_average": load}, indent=1) + "\n")
    except OSError:
        pass
    return hw


def local_cluster(devices: int | None = None, *, refresh: bool = False, notes: list[str] | None = None) -> ClusterSpec:
    """This machine as a one-node cluster of `devices` devices (default: GPUs, else the cores)."""
    world = devices or default_devices()
    return ClusterSpec(hardware=probe_hardware(world, refresh=refresh, notes=notes), nodes=1, devices_per_node=world)
