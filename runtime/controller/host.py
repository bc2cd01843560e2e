"""This machine as the runtime sees it — cores, memory, GPUs, the cache folder — without importing
torch or Ray, so the CLI can check a plan against it in milliseconds before starting anything."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

from hybridflow.simulator.vocabulary.units import MiB


def cache_dir() -> Path:
    """Where warmed-up policies and probed hardware figures are kept: $HFLOW_CACHE or ~/.cache/hybridflow."""
    return Path(os.environ.get("HFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cache_share(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of this CPU's last-level cache per core sharing it (sysfs: the highest cache level of cpu0, its size
    over the CPUs in its shared_cpu_list); 0 where the system does not say."""
    try:
        level = max(root.glob("index*"), key=lambda d: int((d / "level").read_text()))
        size = (level / "size").read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        shared = 0
        for part in (level / "shared_cpu_list").read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            shared += int(hi or lo) - int(lo) + 1
        return int(size.rstrip("KMG")) * scale // max(shared, 1)
    except (OSError, ValueError):
        return 0


def memory_total() -> float:
    """Bytes of physical memory."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def memory_available() -> float:
    """Bytes a new process can still get without swapping (MemAvailable), else the physical total."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return memory_total()


def gpu_memory() -> list[float]:
    """Bytes of memory of each NVIDIA GPU this process may use (CUDA_VISIBLE_DEVICES applies); []
    when there are none or nvidia-smi cannot tell."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        sizes = [float(x) * MiB for x in out.split() if x.strip()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if all(i.isdigit() for i in ids):
            return [sizes[int(i)] for i in ids if int(i) < len(sizes)]
        return sizes[:len(ids)]  # UUIDs: as many as named
    return sizes
