"""`hflow-plan simulate PLAN`: price a plan's dataflow and show its timeline, memory and throughput.

Everything that can fail on bad input (the plan file, the output file names, the pricing) runs
before any output file is written, and both files are rendered before either is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import add_profile_arg, partial_budget_arg, positive_int
from hybridflow.tools.outputs import rendered_outputs, write_outputs
from hybridflow.tools.profile_option import plan_with_profile


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate a plan: op timeline, memory per device, iteration time and tokens/s",
        description="Simulate one or more RLHF iterations of PLAN (JSON or YAML): every op priced by the "
                    "cost model, ops of one colocation group one after another, disjoint groups "
                    "concurrently. Throughput is the HybridFlow paper's metric: prompts x samples x "
                    "(prompt + response length) per iteration second.",
        epilog=examples("hflow-plan simulate examples/plans/ppo-llama2-7b-1x8-colocated.json",
                        "hflow-plan simulate examples/plans/ppo-llama2-13b-2x8-split.json --timeline split.png "
                        "--trace split.json",
                        "hflow-plan simulate examples/plans/tiny-local.json --profile cpu-2core --json"))
    p.add_argument("plan", help="plan file (JSON or YAML), e.g. examples/plans/ppo-llama2-7b-1x8-colocated.json")
    p.add_argument("--iterations", type=positive_int, metavar="N", help="iterations to simulate (default: 1; a "
                   "one-step-off or async plan: two of its weight-sync periods, the iterations `search` prices)")
    p.add_argument("--partial-rollout-tokens", type=partial_budget_arg, metavar="N|auto",
                   help="an async plan's rollout as partial rollouts' rounds of N new tokens per response (the run "
                        "config's async_mode.partial_rollout_tokens); auto: the budget priced fastest of the longest "
                        "response over 2 … k rounds, or none where partial rollouts do not pay (each price is shown)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in https://ui.perfetto.dev)")
    p.add_argument("--timeline", metavar="FILE.png", help="write a PNG Gantt chart, one lane per device group")
    add_profile_arg(p)
    p.set_defaults(func=run)


def simulation_json(plan: Plan, timeline, memory: dict, partial: dict | None = None) -> dict:
    from hybridflow.tools.reports.tables import memory_rows, summary_values

    lanes = timeline.meta.get("lanes", {})
    return {
        "algorithm": plan.algorithm,
        "iterations": len(timeline.iterations()),
        **({"partial_rollouts": partial} if partial is not None else {}),
        **summary_values(timeline),
        "ops": [{"op": e.op, "model": e.role, "group": e.group, "devices": [lanes.get(g, g) for g in e.group.split("+")],
                 "iteration": e.iteration, "start": e.start, "end": e.end, "seconds": e.seconds,
                 "bytes": e.bytes, "flops": e.flops, "breakdown": e.breakdown} for e in timeline.events],
        "memory": memory_rows(memory),
        "fits": all(m.fits for m in memory.values()),
    }


def run(args) -> int:
    from hybridflow.simulator.pricing.plan_memory import plan_memory
    from hybridflow.simulator.schedule.schedule import fastest_partial_budget, simulate
    from hybridflow.simulator.vocabulary.execution import check_partial_budget
    from hybridflow.tools.reports.tables import partial_summary

    if args.timeline and Path(args.timeline).suffix.lower() != ".png":
        raise HflowError(f"{args.timeline}: the timeline picture is a PNG; give a file name ending in .png")
    for path in (args.trace, args.timeline):
        if path and Path(path).is_dir():
            raise HflowError(f"{path}: is a folder; give a file name")
    plan = Plan.load(args.plan)
    budget, partial = args.partial_rollout_tokens, None
    if budget not in (None, "auto"):
        check_partial_budget(plan, budget, "--partial-rollout-tokens")
    plan, cm = plan_with_profile(plan, args.profile or plan.profile)  # the profile it was priced on, by default
    if budget == "auto":
        budget, seconds = fastest_partial_budget(plan, cm, iterations=args.iterations, name="--partial-rollout-tokens auto")
        partial = partial_summary(budget, seconds)
    elif budget is not None:
        partial = {"budget": budget}
    timeline = simulate(plan, cm, iterations=args.iterations, partial_rollout_tokens=budget)
    memory = plan_memory(plan)

    # Render every output before writing any, so a failure leaves no file behind.
    wrote = write_outputs(rendered_outputs(timeline, Path(args.plan).stem, trace=args.trace, png=args.timeline))

    if args.json:
        print(json.dumps(simulation_json(plan, timeline, memory, partial)))
        return 0
    _print_tables(args, plan, timeline, memory, wrote, partial)
    return 0


def _print_tables(args, plan: Plan, timeline, memory, written: list[str], partial: dict | None = None) -> None:
    from rich.console import Console

    from hybridflow.tools.reports.tables import memory_table, ops_table, partial_line, summary_table

    console = Console(file=sys.stdout, width=max(Console().width, 140))
    hw = plan.cluster.hardware
    console.print(f"[bold]{Path(args.plan).name}[/]: {plan.algorithm} on {plan.cluster.nodes}×"
                  f"{plan.cluster.devices_per_node} {hw.name}, {len(plan.groups)} device group(s), "
                  f"reshard {plan.reshard}{', offload' if plan.offload else ''}")
    if partial is not None:
        console.print(partial_line(partial))
    console.print(ops_table(timeline, iteration=timeline.steady_iterations()[0]))  # past a pipeline's warm-up
    capacity = next(iter(memory.values())).capacity if memory else None
    console.print(memory_table(memory, capacity))
    extra = {"wrote": ", ".join(written)} if written else None
    console.print(summary_table(timeline, extra))
    if not all(m.fits for m in memory.values()):
        bad = ", ".join(r for r, m in memory.items() if not m.fits)
        console.print(f"[bold red]warning:[/] {bad} do(es) not fit in device memory under this plan")
