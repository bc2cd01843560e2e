"""`hflow-plan compare`: the searched plan against DeepSpeed-Chat, OpenRLHF, NeMo-Aligner and
HybridFlow-V, all priced by the same simulator (tokens/s and speedup side by side); with more than
one `--backends`, also the best plan of each training engine alone and of their mix (tools/reports/backends.py)."""

from __future__ import annotations

import json
import sys

from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import add_request_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="the searched plan vs DeepSpeed-Chat, OpenRLHF, NeMo-Aligner and HybridFlow-V",
        description="Search the best plan, build each baseline system's plan for the same job and cluster, "
                    "price all of them with the same simulator and show tokens/s and speedups. A baseline "
                    "that does not fit in device memory says why instead of giving a number.",
        epilog=examples("hflow-plan compare --nodes 16 --algo ppo --model llama2-70b",
                        "hflow-plan compare --gpu h100-80g --nodes 2 --algo safe-rlhf --model llama2-13b --json",
                        "hflow-plan compare --nodes 16 --algo ppo --model llama2-13b --backends fsdp,megatron"))
    add_request_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: best, baselines, speedup")
    p.set_defaults(func=run)


def op_breakdown(plans: dict, cost_model) -> dict:
    """Per system: the mechanics its plan is priced with and the seconds of each op in one iteration (summed
    over the op's nodes), so a baseline's mechanics show where they cost (the Hybrid Engine's switches, a
    static batch's generation, a per-tensor weight sync)."""
    from hybridflow.simulator.schedule.schedule import simulate

    return {name: {"mechanics": plan.mechanics.describe(), "ops": simulate(plan, cost_model).op_seconds()}
            for name, plan in plans.items()}


def run(args) -> int:
    from hybridflow.planner.baselines import price_baselines
    from hybridflow.planner.plans import plan_summary, scored_to_plan
    from hybridflow.tools.profile_option import request_with_profile
    from hybridflow.tools.reports.backends import backend_choices
    from hybridflow.tools.search_request import request_from_args, run_search

    req, cm = request_with_profile(request_from_args(args), args.profile)
    planner, result = run_search(req, cm)
    best_plan = scored_to_plan(req, result.best)
    best = plan_summary(best_plan, result.best.seconds)
    priced = price_baselines(req, planner, result)
    baselines = {name: b.json() for name, b in priced.items()}
    breakdown = op_breakdown({"hybridflow": best_plan, **{n: b.plan for n, b in priced.items() if b.fits}},
                             planner.cm)
    speedup = {name: (best["tokens_per_second"] / b["tokens_per_second"] if "tokens_per_second" in b else None)
               for name, b in baselines.items()}
    choices = backend_choices(req, planner.cm, result) if len(req.backends) > 1 else None
    if args.json:
        print(json.dumps({"best": best, "baselines": baselines, "speedup": speedup, "breakdown": breakdown,
                          "search_seconds": result.search_seconds, "plans_priced": result.plans_priced,
                          **({"backends": choices} if choices else {})}))
        return 0
    from rich.console import Console

    from hybridflow.tools.reports.backends import backends_table, ops_table
    from hybridflow.tools.reports.search import breakdown_table, compare_table

    console = Console(file=sys.stdout, width=max(Console().width, 140))
    c = req.cluster
    console.print(f"[bold]{req.algorithm}[/] on {c.nodes}×{c.devices_per_node} {c.hardware.name}, "
                  f"{req.workload.prompts} prompts × {req.workload.samples_per_prompt} samples × "
                  f"({req.workload.prompt_len} + {req.workload.response_len}) tokens per iteration")
    console.print(compare_table(best, baselines))
    console.print(breakdown_table(breakdown))
    if choices:
        console.print(backends_table(choices))
        console.print(ops_table(choices))
    return 0
