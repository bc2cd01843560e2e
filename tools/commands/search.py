"""`hflow-plan search`: the best placement, device allocation and parallel configs for an RLHF job.

Runs Algorithm 1 (planner/search.py) over the cluster, shows the top plans and the chosen plan's
timeline, and can write the plan (`--out`), its Chrome trace and Gantt chart. `--json` prints
one object: best, top, baselines, search_seconds, plans_priced (docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridflow.simulator.algorithms import ROLES, algorithm_names, get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.workload import Workload
from hybridflow.tools.cli_help import examples
from hybridflow.tools.outputs import (
    algorithm_arg,
    backends_arg,
    modes_arg,
    positive_int,
    rendered_outputs,
    write_outputs,
)
from hybridflow.tools.profile_option import add_profile_arg, request_with_profile

# (flag, Workload field, help): the workload flags override the --workload file's fields
WORKLOAD_FLAGS = (
    ("prompt-len", "prompt_len", "prompt tokens"),
    ("response-len", "response_len", "response tokens"),
    ("batch", "prompts", "prompts per iteration"),
    ("samples", "samples_per_prompt", "responses per prompt (GRPO/RLOO draw several)"),
    ("ppo-epochs", "ppo_epochs", "passes over each iteration's batch"),
    ("mini-batches", "mini_batches", "optimizer steps per epoch"),
    ("micro-batch", "micro_batch_size", "sequences per device per forward/backward"),
)


def role_flag(role: str) -> str:
    """The command-line flag of a role: --actor, --cost-critic."""
    return f"--{role.replace('_', '-')}"


def add_request_args(p: argparse.ArgumentParser) -> None:
    """The flags `search` and `compare` share: cluster, algorithm, models, workload."""
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", default="a100-80g", help="hardware preset (a100-80g, h100-80g, h200-141g; any case) or a "
                   "HardwareSpec YAML/JSON file")
    c.add_argument("--nodes", type=positive_int, default=1, help="machines")
    c.add_argument("--gpus-per-node", type=positive_int, default=8, help="devices per machine")
    c.add_argument("--cluster", metavar="FILE.yaml", help="a ClusterSpec file instead of the three flags above")
    m = p.add_argument_group("models")
    m.add_argument("--algo", default="ppo", type=algorithm_arg, metavar="ALGO",
                   help=f"{', '.join(algorithm_names())} (any case)")
    m.add_argument("--model", help="every role's model: a preset (llama2-70b …; any case), a HF folder or a "
                   "ModelSpec YAML; a folder is recorded in the plan as the weights `run` trains")
    for r in ROLES:
        m.add_argument(role_flag(r), dest=r, metavar="MODEL",
                       help=f"the {r} model (overrides --model); a folder is recorded in the plan")
    m.add_argument("--reward-function", metavar="MOD:FN", help="a rule-based reward on the driver instead of a model")
    m.add_argument("--cost-function", metavar="MOD:FN", help="a rule-based cost (safe-rlhf) instead of a model")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="FILE.yaml", help="a Workload file; the flags below override its fields")
    for flag, field, text in WORKLOAD_FLAGS:
        w.add_argument(f"--{flag}", type=positive_int, metavar="N", help=f"{text} (default: the --workload file's, "
                       f"else {Workload.model_fields[field].default})")
    s = p.add_argument_group("search")
    s.add_argument("--max-pp", type=positive_int, help="largest training pipeline-parallel size to consider")
    s.add_argument("--max-gen-pp", type=positive_int, help="largest generation pipeline-parallel size "
                   "(`hflow-plan run` generates with pp=1: give 1 for a plan it can run)")
    s.add_argument("--top", type=positive_int, default=5, metavar="K", help="plans to list")
    s.add_argument("--backends", type=backends_arg, default="fsdp", metavar="LIST",
                   help="training engines to choose from per role: fsdp, megatron or fsdp,megatron (default: fsdp)")
    add_profile_arg(s)


def request_from_args(args):
    from hybridflow.planner.request import SearchRequest
    from hybridflow.simulator.io import load_model_file, read_mapping
    from hybridflow.simulator.vocabulary.hardware import ClusterSpec, HardwareSpec, hardware_preset
    from hybridflow.simulator.vocabulary.model import hf_folder, resolve_model

    if args.cluster:
        cluster = load_model_file(ClusterSpec, args.cluster)
    else:
        gpu = args.gpu
        hw = load_model_file(HardwareSpec, gpu) if Path(gpu).suffix in (".yaml", ".yml", ".json") else hardware_preset(gpu)
        cluster = ClusterSpec(hardware=hw, nodes=args.nodes, devices_per_node=args.gpus_per_node)
    fields = read_mapping(args.workload) if args.workload else {}
    for flag, field, _ in WORKLOAD_FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            fields[field] = value
    workload = Workload.model_validate(fields)
    roles = get_algorithm(args.algo).roles
    given = {r: getattr(args, r) for r in ROLES if getattr(args, r)}
    unused = [r for r in given if r not in roles]
    if unused:
        raise HflowError(f"{role_flag(unused[0])} is not a role of {args.algo} (roles: {', '.join(roles)}); drop it")
    if not args.model and "actor" not in given:
        raise HflowError("give --model NAME (a preset such as llama2-7b, a HF folder or a ModelSpec YAML) "
                         "or --actor and the other roles")
    rules = {"reward": args.reward_function, "cost": args.cost_function}
    for r, fn in rules.items():
        if fn and (":" not in fn or r in given):
            raise HflowError(f"--{r}-function {fn}: give 'module:function' and drop --{r}")
    models, paths = {}, {}
    for r in roles:
        ref = given.get(r) or (None if rules.get(r) else args.model)
        if ref:
            models[r] = resolve_model(ref)
            folder = hf_folder(ref)  # a preset or a ModelSpec file records no path: `run` has no weights for it
            if folder is not None:
                paths[r] = str(folder)
    if paths:  # weights the runtime cannot train are refused now, not after the search
        from hybridflow.tools.preflight.role_folders import check_search_folders

        check_search_folders(paths)
    return SearchRequest(algorithm=args.algo, models=models, paths=paths, cluster=cluster, workload=workload,
                         reward_function=args.reward_function, cost_function=args.cost_function,
                         max_pp=args.max_pp, max_gen_pp=args.max_gen_pp, top_k=args.top, backends=args.backends)


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
    md = p.add_argument_group("execution modes (docs/planner.md)")
    md.add_argument("--modes", type=modes_arg, metavar="LIST", help="search these modes side by side: sync, "
                    "one-step-off, async (comma-separated); the plan is the fastest within --max-staleness")
    md.add_argument("--max-staleness", type=int, default=0, metavar="K", help="the most updates a trained batch's "
                    "policy may lag (default 0: synchronous only; async is searched with bound K)")
    p.set_defaults(func=run)


def run_search(args, req, cm=None):
    """The search with a progress bar on stderr (never on stdout)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridflow.planner.search import Planner

    planner = Planner(req, cm)
    console = Console(file=sys.stderr)
    with Progress(TextColumn("searching placements"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("search", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = planner.run(progress=tick)
    if result.best is None:
        from hybridflow.planner.diagnose import explain_infeasible

        raise HflowError(explain_infeasible(req, planner.cm, sys.stderr))
    return planner, result


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
    if args.modes is not None or args.max_staleness:
        from hybridflow.tools.reports.modes import run_modes

        return run_modes(args)
    req, cm = request_with_profile(request_from_args(args), args.profile)
    planner, result = run_search(args, req, cm)
    plans = [scored_to_plan(req, s) for s in result.top]
    best = plans[0]
    timeline = simulate(best, planner.cm)

    wrote = write_outputs(rendered_outputs(timeline, f"best plan: {req.algorithm}", plan=best, out=args.out,
                                           trace=args.trace, png=args.timeline))

    if args.json:
        baselines = price_baselines(req, planner, result)
        print(json.dumps({
            "best": plan_summary(best, result.top[0].seconds),
            "top": [plan_summary(p, s.seconds) for p, s in zip(plans, result.top, strict=False)],
            "baselines": {name: b.json() for name, b in baselines.items()},
            "search_seconds": result.search_seconds,
            "plans_priced": result.plans_priced,
        }))
        return 0
    from rich.console import Console

    from hybridflow.tools.reports.search import top_plans_table
    from hybridflow.tools.reports.tables import ops_table, summary_table

    console = Console(file=sys.stdout, width=max(Console().width, 140))
    hw = req.cluster.hardware
    console.print(f"[bold]{req.algorithm}[/] on {req.cluster.nodes}×{req.cluster.devices_per_node} {hw.name}: "
                  f"searched in {result.search_seconds:.2f} s, {result.plans_priced:,} plans priced "
                  f"({result.configs_priced:,} model configs)")
    console.print(top_plans_table([plan_summary(p, s.seconds) for p, s in zip(plans, result.top, strict=False)]))
    console.print(ops_table(timeline, iteration=0, title="best plan: ops (simulated, iteration 0)"))
    extra = {"wrote": ", ".join(wrote)} if wrote else None
    console.print(summary_table(timeline, extra))
    return 0
