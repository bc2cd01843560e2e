"""Why a request does not fit its cluster, and the smallest cluster that would fit it."""

from __future__ import annotations

import sys

from hybridflow.planner.configs import generate_configs, searches_sp, train_configs
from hybridflow.planner.placement import allocations, set_partitions
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator.pricing.memory import PARTS, MemoryBreakdown, role_memory
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head
from hybridflow.simulator.vocabulary.units import GiB

MAX_NODES = 4096


def fits_somewhere(req: SearchRequest, cost_model=None) -> bool:
    """Is there any placement and allocation whose every set has configs that fit (under the request's
    offload policy)?"""
    from hybridflow.planner.search import Planner

    for offload in {"never": (False,), "auto": (False, True), "always": (True,)}[req.offload]:
        planner = Planner(req, cost_model, offload=offload)
        for placement in sorted(set_partitions(req.roles), key=len):
            mins = [planner.min_devices(s) for s in placement]
            if all(m is not None for m in mins) and next(allocations(mins, req.cluster), None) is not None:
                return True
    return False


def smallest_cluster(req: SearchRequest) -> int | None:
    """The fewest nodes (of the same kind) on which the request fits; None up to MAX_NODES."""
    def ok(nodes: int) -> bool:
        c = ClusterSpec(hardware=req.cluster.hardware, nodes=nodes, devices_per_node=req.cluster.devices_per_node)
        return fits_somewhere(req.model_copy(update={"cluster": c}))

    lo, hi = req.cluster.nodes, max(1, req.cluster.nodes)
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_NODES:
            return None
    while hi - lo > 1:  # ok(hi), not ok(lo) (lo is the given size, already known not to fit)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def least_memory(req: SearchRequest, role: str, n: int) -> tuple[MemoryBreakdown, str] | None:
    """The role alone on n devices in its least-memory layout among those the search takes (the actor's
    generation in any layout the 3D-HybridEngine reaches from it, up to --max-gen-pp)."""
    model, trained, lora = req.models[role], role in TRAINED_ROLES, req.lora_of(role)
    best = None
    max_pp, backends = (1, ("fsdp",)) if lora is not None else (req.max_pp, req.backends)  # LoRA: FSDP, pp=1
    for cfg in train_configs(model, n, req.cluster.devices_per_node, max_pp, backends=backends,
                             trained=trained, sequence_parallel=searches_sp(req.workload.seq_len) and lora is None):
        if req.max_sp is not None and cfg.sp > req.max_sp:
            continue
        for gen in generate_configs(cfg, req.max_gen_pp) if role == "actor" else (None,):
            m = role_memory(model, role_head(role), cfg, req.workload, trained, req.cluster.hardware, gen=gen,
                            recompute=trained, lora=lora)
            if best is None or m.total < best[0].total:
                best = (m, str(cfg) + (f" {cfg.backend}" if len(req.backends) > 1 else "")
                        + (f" (gen {gen})" if gen is not None and gen != cfg.generation_layout() else ""))
    return best


def explain_infeasible(req: SearchRequest, cost_model, stream=None) -> str:
    """Print each model's least memory per device on the whole cluster (a rich table on `stream`)
    and return the one-line error: what does not fit, and the smallest cluster that would."""
    from rich.console import Console
    from rich.table import Table

    c = req.cluster
    n = c.num_devices
    usable = cost_model.params.usable_bytes(c.hardware.hbm_bytes)
    t = Table(title=f"least memory per device, each model alone on all {n} devices "
                    f"(each {c.hardware.name} offers {usable / GiB:.1f} GiB to models)", title_justify="left")
    for col in ("model", "layout", "weights", "gradients", "optimizer", "activations", "kv cache", "buffers", "total"):
        t.add_column(col, justify="left" if col in ("model", "layout") else "right")
    worst = None
    for role in req.roles:
        got = least_memory(req, role, n)
        if got is None:
            t.add_row(role, "no layout divides the model", *[""] * 7)
            continue
        m, cfg = got
        t.add_row(role, cfg, *[f"{getattr(m, k) / GiB:.1f} GiB" for k in PARTS],
                  f"{m.total / GiB:.1f} GiB")
        if worst is None or m.total > worst[1].total:
            worst = (role, m)
    Console(file=stream or sys.stderr, width=140).print(t)
    nodes = smallest_cluster(req)
    where = f"{c.nodes}x{c.devices_per_node} {c.hardware.name}"
    what = (f"; {worst[0]} alone needs {worst[1].total / GiB:.1f} GiB per device at least ({worst[1].describe()})"
            if worst else "")
    fix = (f"the smallest cluster that fits is {nodes}x{c.devices_per_node} (--nodes {nodes})" if nodes
           else f"no cluster up to {MAX_NODES} nodes fits; use smaller models or shorter sequences")
    if req.offload == "never" and fits_somewhere(req.model_copy(update={"offload": "always"})):
        fix += "; offloading idle models fits it here (--offload auto)"
    return f"{req.algorithm} does not fit on {where}{what}; {fix}"
