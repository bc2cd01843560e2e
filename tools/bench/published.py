"""Published figures: every point of profiles/published.yaml predicted against what its source measured.

    python -m hybridflow.tools.bench.published            # both tiers, the orders, the medians
    python -m hybridflow.tools.bench.published --tier op --json

No torch, no GPU: the op tier is priced on the fitted GPU terms (profiles/gpu-fit.json), the system tier on
each system's mechanics (planner/published_systems.py). For each point: the measured figure, the predicted
one and the signed error (predicted − measured) / measured; per tier the median |error| and the points off
by more than 2× (predicted over 2× or under ½ of the measured); for each workload measured on several systems,
the published order and the predicted one. Targets (issue 33): op median ≤ 15 %, system median ≤ 25 % with
none off by more than 2×, every order as published.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

TARGETS = {"op": 0.15, "system": 0.25}

# Workloads measured on several systems (or execution modes): the ids of one figure each, in no order.
ORDERS = {
    "OpenRLHF benchmark, Llama2-7B PPO on 8 A800 (s per iteration)": [
        "openrlhf-bench-dschat-offload-llama2-7b-8xa800-iteration",
        "openrlhf-bench-dschat-nooffload-llama2-7b-8xa800-iteration",
        "openrlhf-bench-openrlhf-ds-llama2-7b-8xa800-iteration",
        "openrlhf-bench-openrlhf-ray-llama2-7b-8xa800-iteration",
        "openrlhf-bench-openrlhf-rayvllm-llama2-7b-8xa800-iteration"],
    "OpenRLHF benchmark, Llama2-13B PPO on 8 A800 (s per iteration)": [
        "openrlhf-bench-dschat-llama2-13b-8xa800-iteration",
        "openrlhf-bench-openrlhf-ray-llama2-13b-8xa800-iteration",
        "openrlhf-bench-openrlhf-rayvllm-llama2-13b-8xa800-iteration"],
    "HybridFlow §8.2 PPO grid, mean speedup over each baseline (the slowest baseline last)": [
        "hybridflow-ppo-speedup-mean-vs-dschat-grid",
        "hybridflow-ppo-speedup-mean-vs-openrlhf-grid",
        "hybridflow-ppo-speedup-mean-vs-nemo-grid"],
    "NeMo-RL v0.4 GRPO Llama-3.1-8B on 16 H100, on-policy vs one step off (s per step)": [
        "nemo-rl-v0p4-grpo-llama3p1-8b-onpolicy-16xh100", "nemo-rl-v0p4-grpo-llama3p1-8b-1stepoff-16xh100"],
    "NeMo-RL v0.5 GRPO Llama-3.1-8B on 16 H100, on-policy vs one step off (s per step)": [
        "nemo-rl-v0p5-grpo-llama3p1-8b-onpolicy-16xh100", "nemo-rl-v0p5-grpo-llama3p1-8b-1stepoff-16xh100"],
    "NeMo-RL v0.4 GRPO Qwen3-32B, on-policy on 32 H100 vs one step off on 64 (s per step)": [
        "nemo-rl-v0p4-grpo-qwen3-32b-onpolicy-32xh100", "nemo-rl-v0p4-grpo-qwen3-32b-1stepoff-64xh100"],
    "NeMo-RL v0.5 GRPO Qwen3-32B, on-policy on 32 H100 vs one step off on 64 (s per step)": [
        "nemo-rl-v0p5-grpo-qwen3-32b-onpolicy-32xh100", "nemo-rl-v0p5-grpo-qwen3-32b-1stepoff-64xh100"],
}


def predict_all(tiers: tuple[str, ...]) -> list[dict]:
    from hybridflow.planner.published_systems import price_system
    from hybridflow.simulator.calibration.gpu_fit import family_of, stored_terms
    from hybridflow.simulator.calibration.published import analytic, load_published, price_op
    from hybridflow.simulator.errors import HflowError

    terms = stored_terms()
    rows = []
    for p in load_published():
        if p.tier not in tiers or p.setup is None:
            continue
        measured = p.measured.value * p.setup.unit_scale
        row = {"id": p.id, "tier": p.tier, "kind": p.kind, "unit": p.measured.unit, "measured": measured}
        try:
            if p.tier == "op":
                fam = family_of(p.setup.hardware)
                predicted = price_op(p.setup, terms[fam].cost_model if fam in terms else analytic)
            else:
                predicted = price_system(p.setup)
            row.update(predicted=predicted, error=(predicted - measured) / measured)
        except HflowError as e:
            row.update(predicted=None, error=None, why=str(e))
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for tier in ("op", "system"):
        errs = [r["error"] for r in rows if r["tier"] == tier and r["error"] is not None]
        failed = [r["id"] for r in rows if r["tier"] == tier and r["error"] is None]
        if not errs and not failed:
            continue
        over = [r["id"] for r in rows if r["tier"] == tier and r["error"] is not None
                and not 0.5 <= 1 + r["error"] <= 2.0]
        med = statistics.median(abs(e) for e in errs) if errs else None
        out[tier] = {"points": len(errs), "unpriced": failed, "median_abs_error": med, "off_by_2x": over,
                     "target": TARGETS[tier], "met": med is not None and med <= TARGETS[tier] and not failed
                     and (tier == "op" or not over)}
    return out


def orders(rows: list[dict]) -> list[dict]:
    by_id = {r["id"]: r for r in rows}
    out = []
    for title, ids in ORDERS.items():
        got = [by_id[i] for i in ids if i in by_id and by_id[i]["predicted"] is not None]
        if len(got) < len(ids):
            continue
        published = [r["id"] for r in sorted(got, key=lambda r: r["measured"])]
        predicted = [r["id"] for r in sorted(got, key=lambda r: r["predicted"])]
        out.append({"workload": title, "published": published, "predicted": predicted, "same": published == predicted})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", choices=("op", "system"), action="append", help="only these tiers (default: both)")
    ap.add_argument("--json", action="store_true", help="one JSON object: points, summary, orders")
    args = ap.parse_args(argv)
    tiers = tuple(args.tier or ("op", "system"))
    t0 = time.perf_counter()
    rows = predict_all(tiers)
    summ, ords = summary(rows), orders(rows)
    seconds = time.perf_counter() - t0
    torch_free = "torch" not in sys.modules
    ok = all(s["met"] for s in summ.values()) and all(o["same"] for o in ords)
    if args.json:
        print(json.dumps({"points": rows, "summary": summ, "orders": ords, "seconds": seconds,
                          "torch_imported": not torch_free}))
        return 0 if ok else 1
    from rich.console import Console
    from rich.table import Table

    con = Console(width=170)
    for tier in tiers:
        t = Table(title=f"{tier} tier: predicted vs published", title_justify="left")
        for col in ("point", "kind", "unit", "measured", "predicted", "error"):
            t.add_column(col, justify="left" if col in ("point", "kind", "unit") else "right")
        for r in (r for r in rows if r["tier"] == tier):
            if r["error"] is None:
                t.add_row(r["id"], r["kind"], r["unit"][:28], f"{r['measured']:.4g}", "-", f"[red]{r['why'][:60]}[/]")
                continue
            err = f"{r['error']:+.1%}"
            t.add_row(r["id"], r["kind"], r["unit"][:28], f"{r['measured']:.4g}", f"{r['predicted']:.4g}",
                      err if 0.5 <= 1 + r["error"] <= 2 else f"[red]{err}[/]")
        con.print(t)
    for o in ords:
        con.print(f"{'same' if o['same'] else '[red]DIFFERENT[/]'} order — {o['workload']}\n"
                  f"    published: {' < '.join(o['published'])}\n    predicted: {' < '.join(o['predicted'])}")
    for tier, s in summ.items():
        med = "-" if s["median_abs_error"] is None else f"{s['median_abs_error']:.1%}"
        con.print(f"{tier} tier: {s['points']} points, median |error| {med} (target ≤ {s['target']:.0%}), "
                  f"{len(s['off_by_2x'])} off by more than 2x, {len(s['unpriced'])} not priced: "
                  f"{'met' if s['met'] else '[red]not met[/]'}")
    con.print(f"{seconds:.1f} s, torch {'not ' if torch_free else ''}imported")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
