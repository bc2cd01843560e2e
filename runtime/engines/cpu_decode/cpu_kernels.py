"""The C kernels (cpu_kernels.h and the cpu_*.c files it lists), built once per machine into one
library and loaded with ctypes: the fused decode path's attention, RMSNorm, SiLU·up and matmuls
(fast_decode.py, matmul_kernels.py) and the pick of the next tokens, greedy or sampled, with their
log-probs (generation.py), on CPU in fp32.

Why C: a decode step's non-matmul work is many small torch ops, and its attention is one tiny
matrix product per (row, kv head) — per-call overhead, not arithmetic. One pass in C over the
cache does the attention of every row (vLLM's CPU backend ships such kernels for the same reason).
A step of a few rows is a matrix-vector product bound by reading the weights; the libraries' kernels
read them at about half the memory's speed here, a panel-packed loop at about its full speed (and,
with AVX-512, it keeps up with oneDNN at many rows).

The sources are compiled with the system's C compiler (`cc`, or $CC) into a cache folder
($HFLOW_KERNEL_CACHE, default ~/.cache/hybridflow/kernels), named by a hash of the sources, the
flags and this CPU, so each machine builds once (well under a second) and reuses the library;
it is written under a temporary name and renamed, so concurrent workers never load a half-written
file. Without a compiler, or with HFLOW_CPU_KERNELS=0, `kernels()` is None and fast_decode.py runs
the same math as torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")  # the C sources
HEADER = CSRC / "cpu_kernels.h"
SOURCES = tuple(CSRC / f"cpu_{name}.c" for name in ("kernels", "attention", "matmul", "decode"))
# -ffast-math lets the compiler vectorise the sums and expf (glibc's vector expf): results differ
# from torch's by float rounding, as torch's own kernels differ between CPUs. It is given to the
# compile step only: linked with it, gcc adds startup code that turns on flush-to-zero for the
# whole process (every float op of torch and numpy after the library loads would lose subnormals).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC")

# cpu_kernels.c's vector width in floats, and its cache page: CHUNK slots of every (row, kv head)
# together. Its attention runs head_dim in steps of CHUNK floats.
LANES = 8
CHUNK = 4 * LANES
PANEL = 4 * LANES  # output features per panel of a weight packed for panel_matmul


def pages(slots: int) -> int:
    """Cache pages holding `slots` slots."""
    return -(-slots // CHUNK)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _I, _I, _I, _F, _P],
    "silu_mul": [_P, _I, _I, _I, _P],
    "greedy_pick": [_P, _I, _I, _I, _P, _P],
    "sample_pick": [_P, _I, _I, _I, _F, _I, _F, _P, _P, _P, _P, _P],
    "decode_attention": [_P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P],
    "prefill_attention": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _P, _P],
    "pack_panels": [_P, _P, _P, _I, _I, _P],
    "decode_layers": [_I, _P, _P, _I, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _F, _P, _P, _P, _P, _P],
    "panel_matmul": [_P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _F, _I, _P, _P],
}


def _cpu_id() -> str:
    """This CPU's model and feature flags (-march=native builds for them)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [line for line in info if line.startswith(("model name", "flags"))][:2]
        return "\n".join(keep) or platform.processor()
    except OSError:
        return platform.processor()


def library_path(cache_dir: str | os.PathLike | None = None) -> Path:
    cache_dir = Path(cache_dir or os.environ.get("HFLOW_KERNEL_CACHE") or
                     Path.home() / ".cache" / "hybridflow" / "kernels")
    text = b"".join(source.read_bytes() for source in (HEADER, *SOURCES))
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_id().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    return cache_dir / f"cpu_kernels-{key}.so"


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """The compiled library's path, compiling it first if this machine has not yet (raises
    OSError / CalledProcessError when it cannot)."""
    target = library_path(cache_dir)
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    objects = [f"{tmp[:-3]}-{source.stem}.o" for source in SOURCES]
    steps = [[*FLAGS, "-c", "-o", obj, str(source)] for obj, source in zip(objects, SOURCES, strict=True)]
    try:
        for step in [*steps, ["-shared", "-o", tmp, *objects, "-lm"]]:
            subprocess.run([compiler, *step], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent builder's identical file may win, either is fine
    finally:
        for leftover in (tmp, *objects):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


@cache
def kernels() -> ctypes.CDLL | None:
    """The loaded library (functions typed as in cpu_kernels.c), or None where it cannot be built or
    HFLOW_CPU_KERNELS=0; built at most once per process."""
    if os.environ.get("HFLOW_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        warnings.warn(f"hybridflow: CPU decode kernels unavailable ({err}{': ' if detail else ''}"
                      f"{detail.decode(errors='replace').strip()[:200]}); generating with torch ops",
                      RuntimeWarning, stacklevel=2)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.panel_tile_rows.argtypes, lib.panel_tile_rows.restype = [], _I
    return lib
