"""`hflow-plan search --modes sync,one-step-off,async --max-staleness K`: the best plan of each execution
mode side by side, and the fastest within the staleness limit as the plan (planner/modes.py).

The output is the mode table, then the picked plan as a plain `search` shows it (its top plans, its
ops, the summary); `--out/--trace/--timeline` write the picked plan. `--json` prints one object:
mode, max_staleness, modes (per mode: the plan summary with its staleness and the devices for rollout
vs training, and whether it is within the limit), best, top, search_seconds, plans_priced, and for an async
plan under a length distribution `partial_rollouts` (`partial_budget`).
"""

from __future__ import annotations

import json
import sys

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES
from hybridflow.tools.outputs import rendered_outputs, write_outputs
from hybridflow.tools.profile_option import request_with_profile
from hybridflow.tools.search_request import request_from_args


def run_modes(args) -> int:
    from hybridflow.planner.modes import check_modes

    modes = args.modes or EXECUTION_MODES  # --max-staleness alone: every mode
    check_modes(modes, args.max_staleness)
    req, cm = request_with_profile(request_from_args(args), args.profile)
    if req.agent is not None:  # the best plan's timeline priced as the search priced it
        from hybridflow.simulator.agents.planning import agent_cost_model

        cm = agent_cost_model(cm, req.agent, req.cluster)
    return _report(args, req, cm, modes)


def _search(req, cm, modes, max_staleness):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridflow.planner.modes import search_modes

    console = Console(file=sys.stderr)
    with Progress(TextColumn("searching modes"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("search", total=None)
        return search_modes(req, cm, modes, max_staleness,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))


def _report(args, req, cm, modes) -> int:
    from hybridflow.planner.modes import mode_summary, pick_mode
    from hybridflow.planner.plans import plan_summary, scored_to_plan
    from hybridflow.simulator.schedule.schedule import simulate

    k = args.max_staleness
    results = _search(req, cm, modes, k)
    chosen = pick_mode(results, k)
    if chosen is None:
        eligible = [m for m, r in results.items() if r.staleness <= k]
        if "sync" not in eligible:
            raise HflowError(f"no {' or '.join(eligible)} plan fits on {req.cluster.num_devices} device(s): "
                             "those modes generate on devices apart from the training ones; use more devices or "
                             "add sync to --modes")
        from hybridflow.planner.diagnose import explain_infeasible

        raise HflowError(explain_infeasible(req, results["sync"].planners[0].cm, sys.stderr))
    picked = results[chosen]
    plans = [scored_to_plan(req, s) for s in picked.result.top]
    best = plans[0]
    timeline = simulate(best, cm)
    wrote = write_outputs(rendered_outputs(timeline, f"best plan: {req.algorithm}, {chosen}", plan=best, out=args.out,
                                           trace=args.trace, png=args.timeline))

    per_mode = {}
    for mode, r in results.items():
        if r.best is None:
            per_mode[mode] = {"fits": False, "staleness": r.staleness, "within_max_staleness": r.staleness <= k}
        else:
            per_mode[mode] = {**mode_summary(scored_to_plan(req, r.best), r.best.seconds),
                              "within_max_staleness": r.staleness <= k}
    seconds = sum(r.result.search_seconds for r in results.values())
    priced = sum(r.result.plans_priced for r in results.values())
    partial = partial_budget(req, best, cm)
    if args.json:
        print(json.dumps({
            "mode": chosen, "max_staleness": k, "modes": per_mode,
            "best": mode_summary(best, picked.best.seconds),
            "top": [plan_summary(p, s.seconds) for p, s in zip(plans, picked.result.top, strict=True)],
            "search_seconds": seconds, "plans_priced": priced,
            **({"partial_rollouts": partial} if partial is not None else {}),
        }))
        return 0
    from rich.console import Console

    from hybridflow.tools.reports.search import modes_table, top_plans_table
    from hybridflow.tools.reports.tables import ops_table, partial_line, summary_table

    console = Console(file=sys.stdout, width=max(Console().width, 140))
    hw = req.cluster.hardware
    console.print(f"[bold]{req.algorithm}[/] on {req.cluster.nodes}×{req.cluster.devices_per_node} {hw.name}, modes "
                  f"{', '.join(modes)}: searched in {seconds:.2f} s, {priced:,} plans priced")
    console.print(modes_table(per_mode, chosen, k))
    console.print(top_plans_table([plan_summary(p, s.seconds) for p, s in zip(plans, picked.result.top, strict=True)],
                                  title=f"top plans, {chosen} (pp-tp-dp per model)"))
    steady = timeline.steady_iterations()[0]
    console.print(ops_table(timeline, iteration=steady, title=f"best plan: ops (simulated, iteration {steady})"))
    if partial is not None:
        console.print(f"{partial_line(partial)} — a run setting, not the plan's: async_mode.partial_rollout_tokens")
    extra = {"wrote": ", ".join(wrote)} if wrote else None
    console.print(summary_table(timeline, extra))
    return 0


def partial_budget(req, best, cm) -> dict | None:
    """An async plan's partial-rollout budget priced fastest (simulator/schedule/schedule.py fastest_partial_budget)
    with every price, where a long tail of response lengths gives them a tail to cut; None for other plans (and an
    agent's, whose turns are calls of their own)."""
    from hybridflow.simulator.schedule.schedule import fastest_partial_budget
    from hybridflow.tools.reports.tables import partial_summary

    if best.mode != "async" or best.workload.response_lengths is None or req.agent is not None or best.staleness < 2:
        return None
    budget, seconds = fastest_partial_budget(best, cm)
    return partial_summary(budget, seconds)
