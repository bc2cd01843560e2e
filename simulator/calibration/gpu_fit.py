"""The GPU defaults of the cost model: its efficiency terms and engine overheads fitted, per device family, to
the op tier of the published measurements (published.py, profiles/published.yaml).

A family is the device kinds that share a chip (the A100 and its NVLink-cut A800; the Hopper parts), so
its fitted fractions apply to each of them over their own datasheet figures. The terms are mechanisms, not
point corrections: the share of peak a layer's matmuls reach and how it falls with few rows and thin
tensor-parallel shards, attention's slower kernels, the share of HBM bandwidth a decode step streams, the
fixed cost per layer of a decode step (kernel launches, thin kernels) and its extra under tensor
parallelism, a serving engine's per-sequence bookkeeping (and the un-overlapped host work of vLLM before
0.6), how a collective's latency grows with its group,
the links' achieved bandwidth and how much of FSDP's traffic hides under compute. scipy's least_squares
moves them (log-space, soft-L1 on log(predicted/measured), each kind of point weighted equally), from the
same start every time: the fit is deterministic.

    fits = fit_families(load_published())             # {family: FamilyFit}: its terms and error per kind
    write_fits(fits)                                   # profiles/gpu-fit.json, what the defaults read
    cm = default_cost_model(cluster)                   # a CostModel on the fitted terms of the cluster's family
"""

from __future__ import annotations

import json
import math
import statistics
from functools import lru_cache
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from hybridflow.simulator.calibration.fit import Term
from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
from hybridflow.simulator.calibration.published import (
    CollectiveSetup,
    GenerateSetup,
    PublishedPoint,
    TrainSetup,
    price_op,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.vocabulary.hardware import ClusterSpec

FAMILIES: dict[str, tuple[str, ...]] = {"a100": ("a100-80g", "a100-40g", "a800-80g"),
                                        "hopper": ("h100-80g", "h800-80g", "h200-141g", "h20-96g")}
# Each term with physical bounds (no fitted value may leave what the hardware can do) and its scope: fitted
# per family (what differs between chips: their matmul and memory efficiency, how their GEMMs fall off with
# few rows and thin shards, their NVLink) or once for all (what the engines and NCCL do alike on either).
PER_FAMILY = (
    Term("params", "matmul_efficiency", 0.3, 0.95),
    Term("params", "tokens_half", 8.0, 2048.0),
    Term("params", "width_half", 8.0, 4096.0),
    Term("params", "attention_efficiency", 0.15, 1.0),
    Term("params", "hbm_efficiency", 0.5, 0.92),
    Term("params", "intra_link_efficiency", 0.5, 0.95),
)
SHARED = (
    Term("params", "decode_step_overhead", 1e-5, 5e-3),
    Term("params", "inter_link_efficiency", 0.5, 0.98),
    Term("params", "fsdp_overlap", 0.5, 1.0),
    Term("params", "collective_latency_growth", 1e-3, 3.0),
    Term("hardware", "intra_node_latency", 2e-6, 1e-4),
    Term("hardware", "inter_node_latency", 5e-6, 2e-4),
    Term("params", "kv_read_efficiency", 0.2, 1.0),
    Term("params", "deepspeed_efficiency", 0.2, 1.0),
    Term("overheads", "decode_layer_seconds", 1e-7, 2e-4),
    Term("overheads", "tp_decode_layer_seconds", 1e-7, 2e-4),
    Term("overheads", "decode_sequence_seconds", 1e-8, 2e-4),
    Term("overheads", "host_sequence_seconds", 1e-7, 2e-3),
    Term("overheads", "weight_tensor_seconds", 1e-5, 5e-2),
)
# Where each term starts (the analytic model's own defaults, and small overheads).
_START = {"overheads.decode_layer_seconds": 1e-5, "overheads.tp_decode_layer_seconds": 1e-5,
          "overheads.decode_sequence_seconds": 1e-6, "overheads.host_sequence_seconds": 1e-5,
          "overheads.weight_tensor_seconds": 1e-3, "params.collective_latency_growth": 0.1}


def family_of(hardware: str) -> str | None:
    return next((f for f, kinds in FAMILIES.items() if hardware in kinds), None)


class GpuTerms(BaseModel):
    """One family's fitted terms: hardware figures it moves (latencies), efficiency terms, engine overheads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hardware: dict[str, float] = Field(default_factory=dict)
    params: dict[str, float] = Field(default_factory=dict)
    overheads: dict[str, float] = Field(default_factory=dict)

    def cost_model(self, cluster: ClusterSpec, **param_updates) -> ProfiledCostModel:
        hw = cluster.hardware.model_copy(update=self.hardware)
        cluster = cluster.model_copy(update={"hardware": hw})
        params = EfficiencyParams.for_hardware(hw, **{**self.params, **param_updates})
        return ProfiledCostModel(cluster, params, EngineOverheads(**self.overheads))


class KindError(BaseModel):
    points: int
    median: float  # |predicted − measured| / measured
    max: float
    bias: float  # median signed error


class FamilyFit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: str
    terms: GpuTerms
    errors: dict[str, KindError]
    points: dict[str, float]  # point id -> signed error after the fit
    converged: bool


def _point_kind(p: PublishedPoint) -> str:
    s = p.setup
    if isinstance(s, GenerateSetup):
        return "ttft" if s.metric == "ttft_seconds" else "generation"
    if isinstance(s, TrainSetup):
        return "training"
    if isinstance(s, CollectiveSetup):
        return "collective latency" if s.metric == "seconds" else "collective bandwidth"
    return p.kind


def op_points(points, family: str) -> list[PublishedPoint]:
    kinds = FAMILIES[family]
    return [p for p in points if p.tier == "op" and p.setup is not None and p.setup.hardware in kinds]


def _slots() -> list[tuple[str | None, Term]]:
    """The fitted values in order: each family's own terms, then the shared ones (family None)."""
    return [(f, t) for f in FAMILIES for t in PER_FAMILY] + [(None, t) for t in SHARED]


def _terms_from(x: np.ndarray) -> dict[str, GpuTerms]:
    out = {f: {"hardware": {}, "params": {}, "overheads": {}} for f in FAMILIES}
    for (family, t), v in zip(_slots(), np.exp(x), strict=True):
        for f in [family] if family else FAMILIES:
            out[f][t.where][t.field] = float(v)
    return {f: GpuTerms(**d) for f, d in out.items()}


def _start() -> np.ndarray:
    from hybridflow.simulator.vocabulary.hardware import HARDWARE_PRESETS

    defaults = {"params": EfficiencyParams(), "overheads": EngineOverheads(), "hardware": HARDWARE_PRESETS["a100-80g"]}
    vals = []
    for _, t in _slots():
        v = _START.get(t.key, getattr(defaults[t.where], t.field))
        vals.append(min(max(float(v), t.lower * 1.0001), t.upper * 0.9999))
    return np.log(np.array(vals))


def predict(p: PublishedPoint, terms: GpuTerms) -> float:
    return price_op(p.setup, terms.cost_model)


def measured(p: PublishedPoint) -> float:
    return p.measured.value * p.setup.unit_scale


def fit_families(points) -> dict[str, FamilyFit]:
    """Fit every family's own terms and the shared ones to all op-tier points at once (module docstring);
    each (family, kind of point) weighs the same."""
    from scipy.optimize import least_squares

    pts = [(f, p) for f in FAMILIES for p in op_points(points, f)]
    if not pts:
        raise HflowError("no op-tier points to fit")
    groups = [(f, _point_kind(p)) for f, p in pts]
    counts = {g: groups.count(g) for g in set(groups)}
    weights = np.array([1.0 / math.sqrt(counts[g]) for g in groups])
    meas = np.array([measured(p) for _, p in pts])

    def residuals(x):
        terms = _terms_from(x)
        pred = np.array([predict(p, terms[f]) for f, p in pts])
        return weights * np.log(np.maximum(pred, 1e-30) / meas)

    slots = _slots()
    res = least_squares(residuals, _start(), bounds=(np.log([t.lower for _, t in slots]),
                                                      np.log([t.upper for _, t in slots])),
                        loss="soft_l1", f_scale=0.1, diff_step=1e-3, ftol=1e-8, xtol=1e-8, gtol=1e-10,
                        max_nfev=60 * (len(slots) + 1))
    fitted = {f: _rounded(t) for f, t in _terms_from(res.x).items()}
    out = {}
    for f in FAMILIES:
        fam = [p for g, p in pts if g == f]
        errors = {p.id: (predict(p, fitted[f]) - measured(p)) / measured(p) for p in fam}
        out[f] = FamilyFit(family=f, terms=fitted[f], errors=errors_by_kind(fam, errors), points=errors,
                           converged=bool(res.success))
    return out


def _rounded(t: GpuTerms) -> GpuTerms:
    """Six significant figures: what the stored defaults carry (the fit's own tolerance is finer)."""
    def r(d):
        return {k: float(f"{v:.6g}") for k, v in d.items()}
    return GpuTerms(hardware=r(t.hardware), params=r(t.params), overheads=r(t.overheads))


def errors_by_kind(pts, errors: dict[str, float]) -> dict[str, KindError]:
    out: dict[str, list[float]] = {}
    for p in pts:
        out.setdefault(_point_kind(p), []).append(errors[p.id])
    return {k: KindError(points=len(e), median=statistics.median(abs(v) for v in e), max=max(abs(v) for v in e),
                         bias=statistics.median(e)) for k, e in out.items()}


# ---- the stored fit and the defaults it gives ------------------------------------------------------
def fit_path() -> Path:
    return Path(__file__).resolve().parents[2] / "profiles" / "gpu-fit.json"


def write_fits(fits: dict[str, FamilyFit], path: Path | None = None) -> Path:
    from hybridflow.simulator.io import write_atomic

    path = path or fit_path()
    doc = {"version": 1, "families": {f: {"kinds": list(FAMILIES[f]), **fit.model_dump(exclude={"points"})}
                                      for f, fit in fits.items()}}
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


@lru_cache(maxsize=1)
def stored_terms() -> dict[str, GpuTerms]:
    """The shipped fit's terms by family ({} where no fit ships)."""
    path = fit_path()
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    return {f: GpuTerms.model_validate(v["terms"]) for f, v in doc["families"].items()}


def default_cost_model(cluster: ClusterSpec, **param_updates) -> CostModel:
    """The cost model a plan on `cluster` is priced with unless a profile says otherwise: on a GPU family with a
    shipped fit, its fitted terms over the device's datasheet; elsewhere the analytic defaults. `param_updates`:
    EfficiencyParams a run states (its generation engine's, efficiency.engine_params)."""
    family = family_of(cluster.hardware.name)
    terms = stored_terms().get(family) if family else None
    if terms:
        return terms.cost_model(cluster, **param_updates)
    return CostModel(cluster, EfficiencyParams.for_hardware(cluster.hardware, **param_updates) if param_updates
                     else None)
