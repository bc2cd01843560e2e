"""The limits of one sandboxed call (a section of the run config's `agent` settings)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class SandboxLimits(BaseModel):
    """cpu_seconds: RLIMIT_CPU (the kernel sends SIGXCPU, then SIGKILL a second later); wall_seconds: the
    parent kills the call's whole process group (and with it the pid namespace) after this long;
    memory_mb: RLIMIT_AS (an allocation past it fails: MemoryError); output_kb: stdout and stderr go to
    files capped by RLIMIT_FSIZE (SIGXFSZ past it) and at most this much is read back; max_processes:
    RLIMIT_NPROC where the kernel enforces it (not for root); open_files: RLIMIT_NOFILE;
    isolate: run under `unshare` (new user, network, pid and mount namespaces) where the kernel allows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_seconds: PositiveInt = 5
    wall_seconds: float = Field(10.0, gt=0)
    memory_mb: PositiveInt = 512
    output_kb: PositiveInt = 64
    max_processes: PositiveInt = 1
    open_files: PositiveInt = 64
    isolate: bool = True
