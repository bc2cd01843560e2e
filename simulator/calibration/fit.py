"""Calibration: fit the cost model's hardware figures and efficiency terms to a measured profile.

Every profile point is priced by the very CostModel methods that price a plan (train, forward,
generate, reshard, the ring collectives); scipy's least_squares then moves a chosen set of terms
— the HardwareSpec's *effective* figures (FLOP/s, memory and link bandwidth, collective latency)
and EfficiencyParams' shape terms (the few-tokens and thin-shard fall-offs, the per-decode-step
overhead, FSDP overlap, Adam traffic) — to minimise the relative error of every point, each op
kind weighted equally. The efficiency *fractions* are pinned at 1, so the fitted hardware figures
are what the device achieves, not its datasheet.

Bytes: the cost model counts weights and activations at 2 bytes per element (bf16). A profile
measured in fp32 (CPU) moves twice that; collective points are priced at their bf16-equivalent
size, so the fitted bandwidths are per bf16-equivalent byte and stay consistent with the model's
own byte counts.

    cal = calibrate(Profile.load("profiles/cpu-2core.json"))
    cal.errors["generate"].median        # |predicted − measured| / measured, median over its points
    cm = cal.cost_model(cluster)         # a CostModel on the profile's hardware
"""

from __future__ import annotations

import hashlib
import math
import statistics
from functools import lru_cache
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hybridflow.simulator.calibration.measured_terms import measured_directly
from hybridflow.simulator.calibration.profile import COLLECTIVE_OPS, MEGATRON_OPS, Profile, ProfilePoint
from hybridflow.simulator.calibration.profiled_cost import (
    MEGATRON_OVERHEADS,
    EngineOverheads,
    ProfiledCostModel,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import CPU_ATTENTION_KEY_BLOCK, EfficiencyParams
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, HardwareSpec
from hybridflow.simulator.vocabulary.units import BF16
from hybridflow.simulator.vocabulary.workload import Workload

UNLIMITED = 1e18  # free bytes for a profile's generate points: its batch ran whole, as measured
_START_OVERHEADS = EngineOverheads(layer_seconds=1e-4, backward_layer_seconds=2e-4, decode_layer_seconds=1e-4,
                                   tp_layer_seconds=1e-3, tp_backward_layer_seconds=1e-3, tp_decode_layer_seconds=1e-3,
                                   dp_layer_seconds=1e-3, reshard_layer_seconds=1e-3, dp_gather_layer_seconds=1e-3,
                                   call_seconds=1e-3, step_seconds=1e-3,
                                   **{f: 2.0 if f.endswith("ratio") else 1e-3 for f in MEGATRON_OVERHEADS})
FIT_OPS = ("train", "forward", "generate", "reshard", *MEGATRON_OPS, "allreduce", "allgather")


class Term(NamedTuple):
    """One fitted figure: where it lives ("hardware" or "params"), its field, its bounds and, where the base
    value is a flat spot of the fit, the value it starts from (unfitted, the base value stays)."""

    where: Literal["hardware", "params", "overheads"]
    field: str
    lower: float
    upper: float
    start: float | None = None

    @property
    def key(self) -> str:
        return f"{self.where}.{self.field}"


DEFAULT_TERMS: tuple[Term, ...] = (
    Term("hardware", "peak_flops", 1e8, 1e17),
    Term("hardware", "hbm_bandwidth", 1e7, 1e14),
    Term("hardware", "intra_node_bandwidth", 1e6, 1e13),
    Term("hardware", "intra_node_latency", 1e-7, 1.0),
    Term("params", "tokens_half", 1e-2, 1e6),
    Term("params", "width_half", 1e-2, 1e6),
    Term("params", "decode_step_overhead", 1e-7, 1.0),
    Term("params", "kv_read_efficiency", 1e-3, 1.0),
    Term("params", "cache_read_speedup", 1.0, 1e3, start=2.0),  # its bound, 1, is flat
    Term("params", "prefill_attention_efficiency", 1e-3, 2.0),
    Term("params", "fsdp_overlap", 1e-4, 1.0),
    Term("params", "adam_bytes_per_param", 1e-2, 1e3),
    Term("overheads", "layer_seconds", 1e-8, 1.0),
    Term("overheads", "backward_layer_seconds", 1e-8, 1.0),
    Term("overheads", "decode_layer_seconds", 1e-8, 1.0),
    Term("overheads", "tp_layer_seconds", 1e-8, 10.0),
    Term("overheads", "tp_backward_layer_seconds", 1e-8, 10.0),
    Term("overheads", "tp_decode_layer_seconds", 1e-8, 10.0),
    Term("overheads", "dp_layer_seconds", 1e-8, 10.0),
    Term("overheads", "reshard_layer_seconds", 1e-8, 10.0),
    Term("overheads", "dp_gather_layer_seconds", 1e-8, 10.0),
    Term("overheads", "call_seconds", 1e-8, 10.0),
    Term("overheads", "step_seconds", 1e-8, 10.0),
    Term("overheads", "backward_ratio", 0.25, 8.0),
    *(Term("overheads", f, *((0.25, 8.0) if f.endswith("ratio") else (1e-8, 10.0))) for f in MEGATRON_OVERHEADS),
)
# A generate point whose context reaches this many tokens prices the decode's KV reads (kv_read_efficiency) and,
# with a prompt that long, the prefill's attention (prefill_attention_efficiency) above the rest; with shorter
# ones only the weights and the per-step costs show, and both keep their defaults.
KV_CONTEXT_TOKENS = 256
# Fractions pinned at 1: the fitted hardware figures already are the achieved ones. The native
# engine decodes every sequence it is given at once (no max_num_seqs), so no batch cap either.
PINNED = {"matmul_efficiency": 1.0, "hbm_efficiency": 1.0, "intra_link_efficiency": 1.0,
          "inter_link_efficiency": 1.0, "max_decode_batch": 1 << 20}


class OpError(BaseModel):
    """How far one op kind's points sit from the fit: |predicted − measured| / measured."""

    points: int
    median: float
    max: float
    bias: float  # median signed (predicted − measured) / measured: > 0 means over-predicted


class PointFit(BaseModel):
    label: str
    op: str
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


class Calibration(BaseModel):
    """The fit's result: the profile's hardware and efficiency terms, and its error per op kind."""

    model_config = ConfigDict(extra="forbid")

    profile: str
    hardware: HardwareSpec
    params: EfficiencyParams
    overheads: EngineOverheads = EngineOverheads()
    dtype_bytes: int = 4
    terms: dict[str, float] = Field(default_factory=dict)
    errors: dict[str, OpError] = Field(default_factory=dict)
    fit: list[PointFit] = Field(default_factory=list)
    converged: bool = True

    def cluster(self, like: ClusterSpec | None = None, nodes: int = 1, devices_per_node: int = 1) -> ClusterSpec:
        """A cluster of the profile's (fitted) devices, shaped like `like` when given."""
        if like is not None:
            nodes, devices_per_node = like.nodes, like.devices_per_node
        return ClusterSpec(hardware=self.hardware, nodes=nodes, devices_per_node=devices_per_node)

    def cost_model(self, cluster: ClusterSpec | None = None) -> ProfiledCostModel:
        """A CostModel pricing on this profile's hardware, in the shape (nodes × devices) of `cluster`."""
        return ProfiledCostModel(self.cluster(cluster), self.params, self.overheads)


# ---- pricing one point -------------------------------------------------------------------------
def _workload(p: ProfilePoint) -> Workload:
    return Workload(prompts=p.batch, prompt_len=max(p.prompt_len, 1), response_len=max(p.response_len, 1),
                    ppo_epochs=1, mini_batches=p.steps, micro_batch_size=p.micro_batch or p.batch)


def _seq_workload(p: ProfilePoint) -> Workload:
    """train/forward points: the whole sequence as `prompt_len` (a Workload needs both lengths ≥ 1)."""
    seq = p.prompt_len + p.response_len
    return Workload(prompts=p.batch, prompt_len=max(seq - 1, 1), response_len=1 if seq > 1 else 1,
                    ppo_epochs=1, mini_batches=p.steps, micro_batch_size=p.micro_batch or p.batch)


def predict_point(cm: CostModel, p: ProfilePoint, dtype_bytes: int = 4) -> float:
    """Seconds the cost model gives the op a profile point measured."""
    if p.op in ("train", "megatron_train"):
        return cm.train(p.model, p.head, p.parallel, _seq_workload(p)).seconds
    if p.op in ("forward", "megatron_forward"):
        return cm.forward(p.model, p.head, p.parallel, _seq_workload(p), sequences=p.batch).seconds
    if p.op == "generate":
        return cm.generate(p.model, p.parallel, _workload(p), sequences=p.batch,
                           free_bytes_per_device=UNLIMITED).seconds
    if p.op == "dispatch":
        o = getattr(cm, "overheads", None)
        return 0.0 if o is None else o.queued_call_seconds if p.mode == "queued" else o.dispatch_seconds
    if p.op == "reward":
        return p.batch * cm.params.rule_reward_seconds_per_sequence
    if p.op == "reshard":
        return cm.reshard(p.model, p.parallel, p.gen, p.mode).seconds
    if p.op in COLLECTIVE_OPS:
        size = p.size_bytes * BF16 / dtype_bytes  # bf16-equivalent bytes (module docstring)
        ranks = tuple(range(p.group_size))
        bw, lat = (cm.allreduce if p.op == "allreduce" else cm.allgather)(size, p.group_size, ranks)
        return bw + lat
    raise HflowError(f"op kind '{p.op}' is a probe figure, not priced by the cost model")


# ---- the fit -----------------------------------------------------------------------------------
def _build(profile_hw: HardwareSpec, base: EfficiencyParams, terms: tuple[Term, ...], x: np.ndarray,
           overheads: EngineOverheads | None = None) -> tuple[HardwareSpec, EfficiencyParams, EngineOverheads]:
    upd: dict[str, dict] = {"hardware": {}, "params": {}, "overheads": {}}
    for t, v in zip(terms, np.exp(x), strict=True):
        upd[t.where][t.field] = float(v)
    # model_copy(update=...) skips validation: fast inside the optimiser, bounds keep values legal.
    return (profile_hw.model_copy(update=upd["hardware"]), base.model_copy(update=upd["params"]),
            (overheads or EngineOverheads()).model_copy(update=upd["overheads"]))


def _start(hw: HardwareSpec, base: EfficiencyParams, terms: tuple[Term, ...]) -> np.ndarray:
    vals = []
    start = {"hardware": hw, "params": base, "overheads": _START_OVERHEADS}
    for t in terms:
        v = t.start if t.start is not None else getattr(start[t.where], t.field)
        v = 1.0 if v is None else v  # an optional efficiency (None: another's) starts at par
        vals.append(min(max(float(v), t.lower * 1.0001), t.upper * 0.9999))
    return np.log(np.array(vals))


def calibrate(profile: Profile, terms: tuple[Term, ...] = DEFAULT_TERMS, *, ops: tuple[str, ...] = FIT_OPS,
              base: EfficiencyParams | None = None, cluster_devices: int | None = None) -> Calibration:
    """Fit `terms` to the profile's points of kinds `ops` (scipy least_squares, soft-L1 loss on
    log(predicted / measured), each op kind weighted equally) and report the error per op kind.

    Two stages: the hardware, efficiency and FSDP engine terms to every point but the Megatron
    engine's, then the megatron_* overheads alone to the megatron points with the rest held. The
    Megatron points thus add their engine's terms without moving what the others fitted. The
    controller's own points are taken as measured: the dispatch gaps, and the reward points' median
    seconds per sequence as the rule-based reward's price; so is the alone points' speedup
    (alone_speedup)."""
    points = [p for p in profile.points if p.op in ops]
    if not points:
        raise HflowError(f"profile '{profile.name}' has no points of kinds {', '.join(ops)} to fit; "
                         "measure one with `hflow-plan profile`")
    base = (base or EfficiencyParams()).model_copy(update=PINNED)
    dtype_bytes = _dtype_bytes(profile.fingerprint.dtype)
    if profile.fingerprint.device_kind == "cpu":  # the training passes' attention: PyTorch's CPU kernel
        base = base.model_copy(update={"attention_key_block": CPU_ATTENTION_KEY_BLOCK})
        if profile.fingerprint.cache_bytes:  # a decode step's reads the core's cache share keeps (bf16-equivalent)
            base = base.model_copy(update={"decode_cache_bytes": profile.fingerprint.cache_bytes * BF16 / dtype_bytes})
    devices = cluster_devices or max([profile.fingerprint.devices]
                                     + [p.parallel.world_size for p in points] + [p.group_size for p in points])
    engine_terms = tuple(t for t in terms if t.field not in MEGATRON_OVERHEADS)
    megatron_terms = tuple(t for t in terms if t.field in MEGATRON_OVERHEADS)
    shared = [p for p in points if p.op not in MEGATRON_OPS]
    hw, pr, ov, fitted, converged = profile.hardware, base, EngineOverheads(), {}, True
    for stage_points, stage_terms in ((shared, engine_terms), ([p for p in points if p.op in MEGATRON_OPS],
                                                               megatron_terms)):
        if stage_points:
            hw, pr, ov, values, ok = _fit(stage_points, stage_terms, hw, pr, ov, devices, dtype_bytes)
            fitted |= values
            converged = converged and ok
    hw, pr = HardwareSpec.model_validate(hw.model_dump()), EfficiencyParams.model_validate(pr.model_dump())
    pr, ov = measured_directly(profile, pr, ov)
    points += [p for p in profile.points if p.op in ("dispatch", "reward")]
    ov = EngineOverheads.model_validate(ov.model_dump())
    cm = ProfiledCostModel(ClusterSpec(hardware=hw, nodes=1, devices_per_node=devices), pr, ov)
    fit = [PointFit(label=p.label(), op=p.op, measured=p.seconds, predicted=predict_point(cm, p, dtype_bytes))
           for p in points]
    return Calibration(profile=profile.name, hardware=hw.model_copy(update={"source": _source(profile)}),
                       params=pr, overheads=ov, dtype_bytes=dtype_bytes, terms=fitted,
                       errors=errors_by_op(fit), fit=fit, converged=converged)


def _fit(points: list[ProfilePoint], terms: tuple[Term, ...], hw0: HardwareSpec, base: EfficiencyParams,
         ov0: EngineOverheads, devices: int, dtype_bytes: int):
    """One least-squares stage: `terms` (those the points can move) fitted to `points`, starting from
    and otherwise holding (hw0, base, ov0). Returns (hardware, params, overheads, {term: value}, converged)."""
    from scipy.optimize import least_squares

    counts: dict[str, int] = {}
    for p in points:
        counts[p.op] = counts.get(p.op, 0) + 1
    weights = np.array([1.0 / math.sqrt(counts[p.op]) for p in points])
    measured = np.array([p.seconds for p in points])
    # Terms no point can move (no collective points → no bandwidth signal) stay at their start.
    live = tuple(t for t in terms if _moves(t, points, base.decode_cache_bytes > 0))

    def residuals(x):
        hw, pr, ov = _build(hw0, base, live, x, ov0)
        cm = ProfiledCostModel(ClusterSpec(hardware=hw, nodes=1, devices_per_node=devices), pr, ov)
        pred = np.array([predict_point(cm, p, dtype_bytes) for p in points])
        return weights * np.log(np.maximum(pred, 1e-12) / measured)

    x = _start(hw0, base, live)
    converged = True
    if live:
        res = least_squares(residuals, x, bounds=(np.log([t.lower for t in live]), np.log([t.upper for t in live])),
                            loss="soft_l1", f_scale=0.1, x_scale=1.0, diff_step=1e-3, ftol=1e-6, xtol=1e-6,
                            gtol=1e-8, max_nfev=60 * (len(live) + 1))
        x, converged = res.x, bool(res.success)
    hw, pr, ov = _build(hw0, base, live, x, ov0)
    return hw, pr, ov, {t.key: float(v) for t, v in zip(live, np.exp(x), strict=True)}, converged


def _moves(term: Term, points: list[ProfilePoint], cached: bool = False) -> bool:
    """Whether any point's price depends on the term (a crude but exact-enough relevance rule); `cached`: the
    params price a cache for decode reads (decode_cache_bytes > 0)."""
    ops = {p.op for p in points}
    multi = any(p.parallel.world_size > 1 or p.group_size > 1 for p in points)
    needs = {
        "peak_flops": ops & {"train", "forward", "generate"},
        "hbm_bandwidth": ops & {"generate", "train"},
        "intra_node_bandwidth": multi,
        "intra_node_latency": multi,
        "tokens_half": ops & {"train", "forward", "generate"},
        "width_half": ops & {"train", "forward", "generate"},
        "decode_step_overhead": "generate" in ops,
        "cache_read_speedup": cached and "generate" in ops,
        "kv_read_efficiency": any(p.op == "generate" and p.prompt_len + p.response_len >= KV_CONTEXT_TOKENS
                                  and p.response_len > 1 for p in points),
        "prefill_attention_efficiency": any(p.op == "generate" and p.prompt_len >= KV_CONTEXT_TOKENS for p in points),
        "adam_bytes_per_param": "train" in ops,
        "fsdp_overlap": any(p.op in ("train", "forward") and p.parallel.dp > 1 for p in points),
        "layer_seconds": ops & {"train", "forward"},
        "backward_layer_seconds": "train" in ops,
        "backward_ratio": "train" in ops,
        "decode_layer_seconds": "generate" in ops,
        "tp_layer_seconds": any(p.op in ("train", "forward") and p.parallel.tp > 1 for p in points),
        "tp_backward_layer_seconds": any(p.op == "train" and p.parallel.tp > 1 for p in points),
        "tp_decode_layer_seconds": any(p.op == "generate" and p.parallel.tp > 1 for p in points),
        "dp_layer_seconds": any(p.op in ("train", "forward") and p.parallel.dp > 1 for p in points),
        "reshard_layer_seconds": any(p.op == "reshard" and p.parallel.tp * p.parallel.pp > p.gen.tp * p.gen.pp
                                     for p in points),
        "dp_gather_layer_seconds": any(p.op == "reshard" and p.parallel.dp > 1 for p in points),
        "call_seconds": ops & {"train", "forward", "generate"},
        "step_seconds": "train" in ops,
        "megatron_layer_seconds": ops & set(MEGATRON_OPS),
        "megatron_backward_layer_seconds": "megatron_train" in ops,
        "megatron_tp_layer_seconds": any(p.op in MEGATRON_OPS and p.parallel.tp > 1 for p in points),
        "megatron_tp_backward_layer_seconds": any(p.op == "megatron_train" and p.parallel.tp > 1 for p in points),
        "megatron_pp_seconds": any(p.op in MEGATRON_OPS and p.parallel.pp > 1 for p in points),
        "megatron_call_seconds": ops & set(MEGATRON_OPS),
        "megatron_step_seconds": "megatron_train" in ops,
        "megatron_backward_ratio": "megatron_train" in ops,
    }
    return bool(needs.get(term.field, True))


def errors_by_op(fit: list[PointFit]) -> dict[str, OpError]:
    out: dict[str, list[float]] = {}
    for f in fit:
        out.setdefault(f.op, []).append(f.error)
    return {op: OpError(points=len(e), median=statistics.median(abs(v) for v in e), max=max(abs(v) for v in e),
                        bias=statistics.median(e)) for op, e in out.items()}


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}.get(dtype, 4)


def _source(profile: Profile) -> str:
    fp = profile.fingerprint
    return (f"fitted to profile '{profile.name}' ({len(profile.points)} points, {fp.device_kind} {fp.device_name}, "
            f"{fp.dtype}); bandwidths per bf16-equivalent byte")


# ---- entry points for the CLI ------------------------------------------------------------------
CACHE_VERSION = "11"  # bump when the terms or the pricing of points change


@lru_cache(maxsize=8)
def _calibrate_cached(digest: str, text: str) -> Calibration:
    """Fit once per profile content: in memory, and on disk under $HFLOW_CACHE (default
    ~/.cache/hybridflow) so replay/simulate --profile do not refit a file they have seen."""
    import os
    from pathlib import Path

    root = Path(os.environ.get("HFLOW_CACHE", Path.home() / ".cache" / "hybridflow"))
    cached = root / f"calibration-{digest[:24]}.json"
    if cached.is_file():
        try:
            return Calibration.model_validate_json(cached.read_text())
        except ValueError:
            pass  # stale or damaged: fit again
    cal = calibrate(Profile.model_validate_json(text))
    try:
        from hybridflow.simulator.io import write_atomic

        write_atomic(cached, cal.model_dump_json() + "\n")
    except OSError:
        pass  # a read-only home only costs the refit
    return cal


def calibrate_file(path) -> Calibration:
    """Load and fit a profile file (or a shipped profile's name), cached per file content."""
    from hybridflow.simulator.calibration.profile import resolve_profile

    profile = resolve_profile(path)
    text = profile.model_dump_json()
    digest = hashlib.sha256((CACHE_VERSION + text).encode()).hexdigest()
    return _calibrate_cached(digest, text)


def cost_model_from_profile(profile: Profile | Calibration | str, cluster: ClusterSpec | None = None
                            ) -> ProfiledCostModel:
    """A CostModel fitted to `profile` (a Profile, a Calibration, or a file / shipped name), in the
    shape of `cluster` (its nodes × devices per node; its hardware is replaced by the profile's)."""
    if isinstance(profile, Calibration):
        cal = profile
    elif isinstance(profile, Profile):
        cal = calibrate(profile)
    else:
        cal = calibrate_file(profile)
    return cal.cost_model(cluster)


def plan_on_profile(plan, profile_ref) -> tuple[object, CostModel, Calibration]:
    """(the plan moved onto the profile's hardware, its CostModel, the calibration): what
    `simulate --profile FILE` runs. Memory checks then use the profile's device memory too."""
    cal = profile_ref if isinstance(profile_ref, Calibration) else calibrate_file(profile_ref)
    cluster = cal.cluster(plan.cluster)
    moved = plan.model_copy(update={"cluster": cluster})
    return moved, cal.cost_model(cluster), cal
