"""`hflow-plan replay PROFILE`: price plans offline from a recorded profile — no cluster, no torch.

    hflow-plan replay profiles/cpu-2core.json                      # the fit: figures, error per op kind
    hflow-plan replay cpu-2core --plan a.json --plan b.json        # each plan priced on that hardware
    hflow-plan replay cpu-2core --plan a.json --metrics run.jsonl  # predicted vs measured, per op

The metrics file is what `hflow-plan run` appends (runtime/rl/trainer.py): one JSON object per
iteration with `seconds` (the span of the iteration's ops) and `op_seconds` ({op: seconds}, summed
over the roles that ran it). The first `--skip` iterations (default 1: warm-up, first-call costs)
are left out of the measured medians. The comparison is the one `run` prints (tools/reports/comparison.py);
`--speed X` scales the predictions by the machine's speed at the time of the run (the figure `run`
or `hflow-plan profile --check` printed), beside the raw ones.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import read_jsonl
from hybridflow.simulator.vocabulary.timeline import throughput
from hybridflow.tools.cli_help import examples


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "replay", help="price plans offline from a recorded profile; predicted vs measured from a run's metrics",
        description="Fit the cost model to PROFILE (a file written by `hflow-plan profile`, or the name of a "
                    "shipped profile such as cpu-2core) and price plans on that hardware without any cluster "
                    "or torch; with --metrics, compare with what a run measured, op by op.",
        epilog=examples("hflow-plan replay cpu-2core",
                        "hflow-plan replay cpu-2core --plan examples/plans/tiny-local.json",
                        "hflow-plan replay cpu-2core --plan examples/plans/tiny-local.json --metrics run.jsonl "
                        "--speed 1.2"))
    p.add_argument("profile", help="profile file (JSON) or shipped profile name")
    p.add_argument("--plan", action="append", default=[], metavar="PLAN", help="a plan to price (repeatable)")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="a run's metrics (needs exactly one --plan)")
    p.add_argument("--skip", type=int, default=1, metavar="N", help="first iterations to leave out")
    p.add_argument("--speed", type=float, metavar="X", help="the machine's speed when the run ran, now / profiled "
                   "(`run`'s or `profile --check`'s figure): predictions scaled by it are shown beside the raw ones")
    p.add_argument("--points", action="store_true", help="also list every profile point, measured vs fitted")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


# ---- the comparison ------------------------------------------------------------------------------
def read_metrics(path: str | Path, skip: int = 1) -> list[dict]:
    """The iterations of a run's metrics file after the first `skip` (one-line errors)."""
    p = Path(path)
    rows = read_jsonl(p, "the metrics JSONL a `hflow-plan run --metrics FILE` wrote")
    for n, row in enumerate(rows, 1):
        if "op_seconds" not in row or "seconds" not in row:
            raise HflowError(f"{p}: record {n} has no 'seconds'/'op_seconds'; is this a `hflow-plan run` metrics file?")
    if skip < 0:
        raise HflowError(f"--skip {skip}: give 0 or more iterations to leave out")
    if len(rows) <= skip:
        raise HflowError(f"{p}: {len(rows)} iteration(s) recorded, none left after skipping {skip}; "
                         "run more iterations or pass --skip 0")
    return rows[skip:]


def measured_medians(rows: list[dict]) -> tuple[float, dict[str, float]]:
    """(median iteration seconds, median seconds per op) over the iterations."""
    ops = sorted({op for r in rows for op in r["op_seconds"]})
    return (statistics.median(r["seconds"] for r in rows),
            {op: statistics.median(r["op_seconds"].get(op, 0.0) for r in rows) for op in ops})


# ---- the command ---------------------------------------------------------------------------------
def run(args) -> int:
    from hybridflow.simulator.calibration.fit import calibrate_file, plan_on_profile
    from hybridflow.simulator.vocabulary.plan import Plan
    from hybridflow.tools.reports.comparison import Comparison, predict_plan

    if args.metrics and len(args.plan) != 1:
        raise HflowError("--metrics compares one run with one plan: pass exactly one --plan (the plan that ran)")
    if args.speed is not None and (not args.metrics or args.speed <= 0):
        raise HflowError(f"--speed {args.speed}: give a positive figure, with --metrics (it scales the predictions "
                         "compared with the run)")
    cal = calibrate_file(args.profile)
    plans = [(path, Plan.load(path)) for path in args.plan]
    priced = []
    for path, plan in plans:
        moved, cm, _ = plan_on_profile(plan, cal)
        it, ops = predict_plan(moved, cm)
        priced.append({"plan": path, "iteration_seconds": it,
                       "tokens_per_second": throughput(plan.workload.tokens_per_iteration, it),
                       "op_seconds": ops, "plan_hardware": plan.cluster.hardware.name,
                       "hardware_mismatch": plan.cluster.hardware.name != cal.hardware.name})
    comparison = None
    if args.metrics:
        rows = read_metrics(args.metrics, args.skip)
        m_it, m_ops = measured_medians(rows)
        comparison = Comparison(priced[0]["iteration_seconds"], priced[0]["op_seconds"], m_it, m_ops,
                                plans[0][1].workload.tokens_per_iteration,
                                f"median of {len(rows)} iteration(s) after the first {args.skip}", args.speed,
                                "the --speed given")
    if args.json:
        print(json.dumps({"profile": cal.profile, "hardware": cal.hardware.model_dump(), "terms": cal.terms,
                          "errors": {k: v.model_dump() for k, v in cal.errors.items()}, "plans": priced,
                          "comparison": {**comparison.json(), "iterations": len(rows)} if comparison else None}))
        return 0
    _print(args, cal, priced, comparison)
    return 0


def _print(args, cal, priced: list[dict], comparison) -> None:
    from rich.console import Console
    from rich.table import Table

    from hybridflow.tools.reports.comparison import comparison_table, speed_line
    from hybridflow.tools.reports.fit import print_fit

    console = Console(file=sys.stdout, width=max(Console().width, 120))
    print_fit(cal, console)
    if args.points:
        t = Table(title="profile points: measured vs fitted")
        for col in ("point", "measured s", "fitted s", "error"):
            t.add_column(col, justify="left" if col == "point" else "right")
        for f in cal.fit:
            t.add_row(f.label, f"{f.measured:.4g}", f"{f.predicted:.4g}", f"{f.error:+.1%}")
        console.print(t)
    for p in priced:
        warn = f" [yellow](the plan names {p['plan_hardware']}; priced on the profile's devices)[/]" \
            if p["hardware_mismatch"] else ""
        console.print(f"[bold]{p['plan']}[/]: {p['iteration_seconds']:.3f} s per iteration, "
                      f"{p['tokens_per_second']:,.0f} tokens/s on {cal.hardware.name}{warn}")
        if comparison is None:
            console.print("  " + ", ".join(f"{op} {s:.3f} s" for op, s in p["op_seconds"].items()))
    if comparison:
        console.print(comparison_table(comparison))
        console.print(speed_line(comparison))
