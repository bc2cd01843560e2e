"""Planner speed: wall seconds of the whole `hflow-plan search` process, pinned to one CPU core.

    python -m hybridflow.tools.bench.planner_speed            # the three cases of issue 3
    python -m hybridflow.tools.bench.planner_speed --case ppo-70b-128

Each case runs `hflow-plan search ... --json` in a fresh process (imports included) restricted
to one core (sched_setaffinity), and reports wall seconds, CPU seconds, the search's own seconds,
plans priced and the best plan's tokens/s, against the target.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

CASES = {
    "ppo-70b-128": (["--nodes", "16", "--gpus-per-node", "8", "--algo", "ppo", "--model", "llama2-70b"], 5.0),
    "safe-rlhf-13b-128": (["--nodes", "16", "--gpus-per-node", "8", "--algo", "safe-rlhf", "--model", "llama2-13b"],
                          20.0),
    "ppo-7b-1024": (["--nodes", "128", "--gpus-per-node", "8", "--algo", "ppo", "--model", "llama2-7b"], 60.0),
}
COMMON = ["--gpu", "a100-80g", "--prompt-len", "1024", "--response-len", "1024", "--batch", "1024"]


def _one_core():
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_case(name: str) -> dict:
    flags, target = CASES[name]
    cmd = [sys.executable, "-m", "hybridflow.tools.cli", "search", *COMMON, *flags, "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_one_core)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        return {"case": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}
    out = json.loads(proc.stdout)
    return {"case": name, "wall_seconds": wall, "cpu_seconds": cpu, "search_seconds": out["search_seconds"],
            "plans_priced": out["plans_priced"], "tokens_per_second": out["best"]["tokens_per_second"],
            "placement": " | ".join("+".join(g) for g in out["best"]["placement"]), "target_seconds": target,
            "met": wall <= target}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=list(CASES), action="append", help="run only these cases")
    ap.add_argument("--json", action="store_true", help="print one JSON object per case")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    rows = [run_case(c) for c in (args.case or list(CASES))]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0 if all(r.get("met") for r in rows) else 1
    t = Table(title="hflow-plan search, whole process on one core (target: wall ≤ target)", title_justify="left")
    for col in ("case", "wall s", "cpu s", "search s", "plans priced", "best tokens/s", "best placement", "target s",
                "met"):
        t.add_column(col, justify="left" if col in ("case", "best placement") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(r["case"], "error", str(r["error"]), *[""] * 6)
            continue
        t.add_row(r["case"], f"{r['wall_seconds']:.2f}", f"{r['cpu_seconds']:.2f}", f"{r['search_seconds']:.2f}",
                  f"{r['plans_priced']:,}", f"{r['tokens_per_second']:,.0f}", r["placement"],
                  f"{r['target_seconds']:.0f}", "yes" if r["met"] else "[red]NO[/]")
    Console(width=160).print(t)
    return 0 if all(r.get("met") for r in rows) else 1


if __name__ == "__main__":
    run_main(main)
