"""Profile: measured op costs on one machine — the data the simulator calibrates itself against.

A profile is a hardware fingerprint (what machine, which torch, how many devices), the probed
hardware figures (a HardwareSpec: the starting point of the fit) and a list of measured points.
Each point names an op kind, the model shape, the parallel layout, the batch and lengths it ran
with, and the seconds it took (median over `repeats` runs after warm-up, with their spread). The
schema is versioned and documented in profiles/README.md; `hflow-plan profile` writes it,
`calibration/fit.py` fits the cost model to it. Pure pydantic: no torch needed to read one.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import SPEC_SUFFIXES
from hybridflow.simulator.names import lookup
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, HardwareSpec
from hybridflow.simulator.vocabulary.model import Head, ModelSpec, preset_if_named
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.units import MiB

PROFILE_VERSION = 1

# What a point measured. Model ops price through CostModel (train, forward, generate, reshard; the
# megatron_* kinds are a train step / a log-prob or value forward of the megatron-core engine, whose
# layout says backend: megatron); collectives through its ring formulas; matmul / memory are the
# probe's raw figures; dispatch and reward are the single controller's own (taken as measured); alone
# is a one-device point timed with the other devices idle and busy (the alone_speedup, as measured).
OpKind = Literal["train", "forward", "generate", "reshard", "megatron_train", "megatron_forward", "allreduce",
                 "allgather", "dispatch", "reward", "alone", "matmul", "memory"]
MEGATRON_OPS = ("megatron_train", "megatron_forward")
MODEL_OPS = ("train", "forward", "generate", "reshard", *MEGATRON_OPS)
PASS_OPS = ("train", "forward", *MEGATRON_OPS)  # whole sequences through the training engine
COLLECTIVE_OPS = ("allreduce", "allgather")
OP_KINDS: tuple[str, ...] = (*MODEL_OPS, *COLLECTIVE_OPS, "dispatch", "reward", "alone", "matmul", "memory")


class Fingerprint(BaseModel):
    """Which machine a profile describes; `same_machine` compares the parts that change costs."""

    model_config = ConfigDict(extra="forbid")

    hostname: str = ""
    platform: str = ""
    processor: str = ""
    cpu_count: NonNegativeInt = 0  # logical cores the measuring processes could use
    device_kind: Literal["cpu", "cuda"] = "cpu"
    device_name: str = ""  # CPU model name or CUDA device name
    devices: PositiveInt = 1  # devices per node the profile used (CPU: gloo processes)
    torch_version: str = ""
    dtype: str = "float32"  # element type the engines ran in (fp32 on CPU, bf16 on GPUs)
    # bytes of the last-level cache per CPU core sharing it (a CPU device's share; 0: unknown, or a GPU, whose
    # cache holds a sliver of a model's weights): calibration prices decode reads that fit it
    cache_bytes: NonNegativeInt = 0
    created: str = ""  # ISO-8601 UTC

    def same_machine(self, other: Fingerprint) -> bool:
        return (self.device_kind, self.device_name, self.cpu_count) == (other.device_kind, other.device_name,
                                                                        other.cpu_count)


class ProfilePoint(BaseModel):
    """One measured op. Field use by op kind:

    - train / forward: `model`, `head`, `parallel`, `batch` sequences of `prompt_len + response_len`
      tokens, `micro_batch`, `steps` optimizer steps (train);
    - megatron_train / megatron_forward: the same, on the megatron-core engine (`parallel.backend`
      is "megatron");
    - generate: `model`, `parallel` = the generation layout, `batch` prompts of `prompt_len`,
      `response_len` new tokens (1: prefill only);
    - reshard: `model`, `parallel` = training layout, `gen` = generation layout, `mode`;
    - allreduce / allgather: `size_bytes` (the full reduced / gathered tensor), `group_size` ranks;
    - dispatch: the single controller's gap between calls on a group of `group_size` workers passing
      `batch` sequences of `prompt_len` tokens, `mode` "dependent" (after the call its input came
      from) or "queued" (after the call before it on the group; runtime/measure/dispatch_probe.py);
    - reward: a rule-based reward function on the controller scoring `batch` responses of
      `response_len` tokens, decoding included (`mode`: the built-in task; runtime/measure/reward_probe.py);
    - alone: a one-device reference point (`mode`: its op, train / forward / generate; `model`, `head`,
      `batch`, `micro_batch`, `steps`, lengths as that op's) run on `group_size` devices at once, each its
      own copy: 1 with the other devices idle, all of them as the profile times every point
      (runtime/measure/alone_probe.py);
    - matmul: `size_bytes` = n (an n×n×n GEMM); memory: `size_bytes` copied.
    """

    model_config = ConfigDict(extra="forbid")

    op: OpKind
    model: ModelSpec | None = None
    head: Head = "lm"
    parallel: ParallelConfig = ParallelConfig()
    gen: ParallelConfig | None = None
    mode: str | None = None  # reshard mode
    batch: PositiveInt = 1
    micro_batch: PositiveInt | None = None
    steps: PositiveInt = 1
    prompt_len: NonNegativeInt = 0
    response_len: NonNegativeInt = 0
    size_bytes: NonNegativeFloat = 0.0
    group_size: PositiveInt = 1
    seconds: float = Field(gt=0, description="median over the repeats (of the passes' medians, when several)")
    std: NonNegativeFloat = 0.0
    repeats: PositiveInt = 1
    bytes: NonNegativeFloat = 0.0  # bytes moved per device (network for collectives/reshard), as measured
    flops: NonNegativeFloat = 0.0

    @model_validator(mode="before")
    @classmethod
    def _model_by_name(cls, data):
        return preset_if_named(data)

    @model_validator(mode="after")
    def _complete(self):
        if self.op in MODEL_OPS and self.model is None:
            raise ValueError(f"a '{self.op}' point needs its model shape")
        if self.op in PASS_OPS and self.prompt_len + self.response_len == 0:
            raise ValueError(f"a '{self.op}' point needs a sequence length (prompt_len + response_len > 0)")
        if self.op in PASS_OPS and (self.op in MEGATRON_OPS) != (self.parallel.backend == "megatron"):
            raise ValueError(f"a '{self.op}' point with parallel.backend '{self.parallel.backend}': the megatron "
                             "engine's points are op megatron_train / megatron_forward with backend megatron")
        if self.op == "generate" and (self.prompt_len < 1 or self.response_len < 1):
            raise ValueError("a 'generate' point needs prompt_len >= 1 and response_len >= 1")
        if self.op == "reshard" and (self.gen is None or self.mode is None):
            raise ValueError("a 'reshard' point needs the generation layout 'gen' and the 'mode'")
        if self.op in (*COLLECTIVE_OPS, "matmul", "memory") and self.size_bytes <= 0:
            raise ValueError(f"a '{self.op}' point needs size_bytes > 0")
        return self

    def label(self) -> str:
        """A short human name: op, model, layout and shape."""
        if self.op in COLLECTIVE_OPS:
            return f"{self.op} {self.size_bytes / MiB:.2f} MiB ×{self.group_size}"
        if self.op == "dispatch":
            return f"dispatch {self.mode or 'dependent'} b{self.batch}×{self.prompt_len} ×{self.group_size}"
        if self.op == "reward":
            return f"reward {self.mode or ''} b{self.batch}×{self.response_len}"
        if self.op == "alone":
            name = self.model.name if self.model else "?"
            return f"alone {self.mode} {name} b{self.batch} {self.prompt_len}+{self.response_len} on {self.group_size} busy"
        if self.op in ("matmul", "memory"):
            return f"{self.op} {self.size_bytes:.0f}"
        name = self.model.name if self.model else "?"
        if self.op == "reshard":
            return f"reshard {name} {self.parallel.label()}→{self.gen.label()} {self.mode}"
        return f"{self.op} {name} {self.parallel.label()} b{self.batch} {self.prompt_len}+{self.response_len}"


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = PROFILE_VERSION
    name: str
    fingerprint: Fingerprint
    hardware: HardwareSpec  # the probe's figures (per device); the fit starts here
    points: list[ProfilePoint] = Field(default_factory=list)
    notes: str = ""

    # ---- views ------------------------------------------------------------------------------
    def by_op(self) -> dict[str, list[ProfilePoint]]:
        out: dict[str, list[ProfilePoint]] = defaultdict(list)
        for p in self.points:
            out[p.op].append(p)
        return dict(out)

    def cluster(self, nodes: int = 1, devices_per_node: int | None = None) -> ClusterSpec:
        """A cluster of this profile's devices (default: as many per node as it was measured on)."""
        return ClusterSpec(hardware=self.hardware, nodes=nodes,
                           devices_per_node=devices_per_node or self.fingerprint.devices)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per op kind: points and the median relative spread (std / seconds) of their repeats."""
        out = {}
        for op, pts in self.by_op().items():
            out[op] = {"points": len(pts), "median_rel_std": statistics.median(p.std / p.seconds for p in pts)}
        return out

    # ---- files ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file (one-line HflowError for a missing, malformed or foreign file)."""
        from hybridflow.simulator.io import load_model_file, read_mapping

        data = read_mapping(path)
        if data.get("version") not in (None, PROFILE_VERSION):
            raise HflowError(f"{path}: profile version {data.get('version')} is not supported (this build reads "
                             f"version {PROFILE_VERSION}); re-measure it with `hflow-plan profile`")
        if "points" not in data or "fingerprint" not in data:
            raise HflowError(f"{path}: not a profile (no 'points'/'fingerprint'); write one with "
                             "`hflow-plan profile --out FILE.json`")
        return load_model_file(cls, path)

    def save(self, path: str | Path) -> Path:
        from hybridflow.simulator.io import write_atomic

        return write_atomic(path, self.model_dump_json(indent=1, exclude_defaults=False) + "\n")


def shipped_profile_path(name: str = "cpu-2core") -> Path:
    """The path of a profile that ships with the package (profiles/NAME.json)."""
    # profiles/ sits beside simulator/ in the source tree and in the installed package alike
    # (hybridflow/profiles): found by path, so the simulator imports nothing of ours.
    folder = Path(__file__).resolve().parents[2] / "profiles"
    known = sorted(p.stem for p in folder.glob("*.json"))
    return folder / f"{lookup(name, known, 'shipped profile', 'or pass a file path', known_as='shipped')}.json"


def resolve_profile(ref: str | Path) -> Profile:
    """A profile file path, or the name of a shipped profile ("cpu-2core")."""
    p = Path(ref)
    if p.suffix in SPEC_SUFFIXES or p.exists():
        return Profile.load(p)
    return Profile.load(shipped_profile_path(str(ref)))
