"""`hflow-plan search`: the best placement, device allocation and parallel configs for an RLHF job.

Runs Algorithm 1 (planner/search.py) over the cluster, shows the top plans and the chosen plan's
timeline, and can write the plan (`--out`), its Chrome trace and Gantt chart. `--json` prints
one object: best, top, baselines, search_seconds, plans_priced (docs/planner.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import add_request_args, modes_arg
from hybridflow.tools.outputs import rendered_outputs, write_outputs
from hybridflow.tools.profile_option import request_with_profile
from hybridflow.tools.search_request import request_from_args, run_search
from hybridflow.tools.task_options import check_search_task


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "search", help="search placements, allocations and parallel configs for the fastest plan (Algorithm 1)",
        description="Find the plan with the highest simulated throughput (tokens/s = prompts x samples x "
                    "(prompt + response length) per iteration second) over every colocation of the models, "
                    "every allocation of the cluster's devices and every 3D-parallel config.",
        epilog=examples("hflow-plan search --gpu a100-80g --nodes 16 --gpus-per-node 8 --algo ppo --model llama2-70b",
                        "hflow-plan search --nodes 16 --algo grpo --samples 4 --model llama2-7b "
                        "--modes sync,one-step-off,async --max-staleness 2 --out plan.json",
                        "hflow-plan search --model tiny --gpus-per-node 2 --profile cpu-2core --algo GRPO --json"))
    add_request_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="PLAN.json", help="write the best plan (input of `hflow-plan simulate`)")
    o.add_argument("--trace", metavar="FILE.json", help="write the best plan's Chrome trace (Perfetto)")
    o.add_argument("--timeline", metavar="FILE.png", help="write the best plan's Gantt chart")
    o.add_argument("--json", action="store_true", help="print one JSON object (see docs/planner.md)")
    o.add_argument("--debug", action="store_true", help="with an error in your own code (a reward or cost function), "
                   "also print its traceback")
    md = p.add_argument_group("execution modes (docs/planner.md)")
    md.add_argument("--modes", type=modes_arg, metavar="LIST", help="search these modes side by side: sync, "
                    "one-step-off, async (comma-separated); the plan is the fastest within --max-staleness")
    md.add_argument("--max-staleness", type=int, default=0, metavar="K", help="the most updates a trained batch's "
                    "policy may lag (default 0: synchronous only; async is searched with bound K)")
    ag = p.add_argument_group("multi-turn agent rollouts (docs/agents.md)")
    ag.add_argument("--agent-workload", metavar="FILE", help="price generation as conversations with tool calls: a "
                    "YAML/JSON of distributions (turns, tool_seconds, turn_tokens, tool_turn_tokens) and the runner's "
                    "tool_workers, overlap (simulator/agents/planning.py AgentWorkload; runtime/measure/agent_probe.py "
                    "writes one)")
    p.set_defaults(func=run)


def _check_outputs(args) -> None:
    for path, suffix in ((args.out, ".json"), (args.trace, ".json"), (args.timeline, ".png")):
        if path and Path(path).suffix.lower() != suffix:
            raise HflowError(f"{path}: expected a file name ending in {suffix}")
        if path and Path(path).is_dir():
            raise HflowError(f"{path}: is a folder; give a file name")


def run(args) -> int:
    from hybridflow.planner.baselines import price_baselines
    from hybridflow.planner.plans import plan_summary, scored_to_plan
    from hybridflow.simulator.schedule.schedule import simulate

    _check_outputs(args)
    warning = check_search_task(args)  # the reward / cost functions importable, a group algorithm given samples
    if args.modes is not None or args.max_staleness:
        from hybridflow.tools.reports.modes import run_modes

        return run_modes(args)
    req, cm = request_with_profile(request_from_args(args), args.profile)
    if req.agent is not None:
        from hybridflow.simulator.agents.planning import agent_cost_model

        cm = agent_cost_model(cm, req.agent, req.cluster)
    planner, result = run_search(req, cm)
    plans = [scored_to_plan(req, s) for s in result.top]
    best = plans[0]
    # under a length distribution, what a fixed-length planner would pick and promise at the longest response
    at_longest = _at_longest(req, cm) if req.workload.response_lengths is not None else None
    timeline = simulate(best, planner.cm)
    # the plan remembers the profile it was priced on (simulate and run price it the same) and names its
    # files relative to its own folder (run from anywhere, moved with them)
    profile = str(Path(args.profile).absolute()) if args.profile and Path(args.profile).is_file() else args.profile
    written = best.model_copy(update={"profile": profile}) if profile else best
    written = written.with_paths(Path(args.out).absolute().parent, anchor=False) if args.out else written

    wrote = write_outputs(rendered_outputs(timeline, f"best plan: {req.algorithm}", plan=written, out=args.out,
                                           trace=args.trace, png=args.timeline))
    if warning:
        print(warning, file=sys.stderr)

    variants = None
    if req.lora is not None:  # the same job fully fine-tuned, each on its smallest cluster (planner/lora.py)
        from hybridflow.planner.lora import compare_lora

        variants = compare_lora(req, planner.cm)
    if args.json:
        baselines = price_baselines(req, planner, result)
        out = {
            "best": plan_summary(best, result.top[0].seconds),
            "top": [plan_summary(p, s.seconds) for p, s in zip(plans, result.top, strict=False)],
            "baselines": {name: b.json() for name, b in baselines.items()},
            "search_seconds": result.search_seconds,
            "plans_priced": result.plans_priced,
        }
        if variants is not None:
            from hybridflow.tools.reports.lora import lora_json

            out["lora"] = lora_json(variants)
        if at_longest is not None:
            plan, seconds = at_longest
            out["at_longest"] = plan_summary(plan, seconds) if plan else {"fits": False, "reason": seconds}
        print(json.dumps(out))
        return 0
    from rich.console import Console

    from hybridflow.tools.reports.search import top_plans_table
    from hybridflow.tools.reports.tables import ops_table, summary_table

    console = Console(file=sys.stdout, width=max(Console().width, 140))
    hw = req.cluster.hardware
    console.print(f"[bold]{req.algorithm}[/] on {req.cluster.nodes}×{req.cluster.devices_per_node} {hw.name}: "
                  f"searched in {result.search_seconds:.2f} s, {result.plans_priced:,} plans priced "
                  f"({result.configs_priced:,} model configs)")
    if req.workload.response_lengths is not None:
        console.print(f"response lengths: {req.workload.response_lengths.describe()} (generation under continuous "
                      "batching, the slowest replica's tail; training on packed tokens; memory for the longest)")
    if result.best.offload and req.offload == "auto":
        console.print("no plan fits with every model resident: these plans move idle colocated models' states to "
                      "host memory and back (onload/offload below; --offload never to refuse)")
    console.print(top_plans_table([plan_summary(p, s.seconds) for p, s in zip(plans, result.top, strict=False)]))
    console.print(ops_table(timeline, iteration=0, title="best plan: ops (simulated, iteration 0)"))
    console.print(f"best plan's knobs (`run` uses them): {knobs_line(best)}")
    if at_longest is not None:
        plan, seconds = at_longest
        longest = f"if every response were the longest, {req.workload.response_len:,} tokens"
        if plan is None:
            console.print(f"{longest}: {seconds}")
        else:
            console.print(top_plans_table([plan_summary(plan, seconds)], title=f"{longest}: the plan a fixed-length "
                                          f"search picks ({seconds / result.top[0].seconds:.1f}× this one's time)"))
            console.print(f"its knobs: {knobs_line(plan)}")
    extra = {"wrote": ", ".join(wrote)} if wrote else None
    console.print(summary_table(timeline, extra))
    if variants is not None:
        from hybridflow.tools.reports.lora import lora_table

        console.print(lora_table(variants, req.cluster))
    return 0


def _at_longest(req, cm):
    """(plan, seconds) of the search with every response at the distribution's longest, or (None, why not):
    the plan and the price a planner of fixed lengths would give (docs/planner.md)."""
    from hybridflow.planner.plans import scored_to_plan

    fixed = req.model_copy(update={"workload": req.workload.model_copy(update={"response_lengths": None})})
    try:
        _, result = run_search(fixed, cm)
    except HflowError as e:
        return None, str(e).splitlines()[0]
    return scored_to_plan(fixed, result.top[0]), result.top[0].seconds


def knobs_line(plan) -> str:
    """The settings the plan carries for `run`: micro-batch token budgets, the rollout engine's memory share
    and concurrent sequences."""
    w, actor = plan.workload, plan.roles["actor"]
    budgets = [f"{r} {rp.micro_batch_tokens:,}" for r, rp in plan.roles.items() if rp.micro_batch_tokens is not None]
    parts = [f"micro-batch token budget {', '.join(budgets)}" if budgets else f"micro-batch {w.micro_batch_size} rows"]
    if actor.rollout_memory_fraction is not None:
        parts.append(f"rollout memory fraction {actor.rollout_memory_fraction:.2f}")
    if actor.max_concurrent_sequences is not None:
        parts.append(f"at most {actor.max_concurrent_sequences:,} sequences decoded at once per replica")
    return "; ".join(parts)
