"""`hflow-plan run PLAN`: execute a plan's RLHF algorithm on Ray, exactly as the plan places it.

Local Ray by default (`--address` joins a cluster). Per iteration: a progress bar with reward,
KL and tokens/s; a JSON line in `--metrics`; the measured timeline (`--trace`, `--timeline`).
At the end: predicted (simulator) vs measured seconds per op and per iteration.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.outputs import positive_int
from hybridflow.tools.profile_option import add_profile_arg, plan_with_profile


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="run a plan: RLHF iterations on Ray, measured timeline, predicted vs measured",
        description="Run PLAN's algorithm (`hflow-plan search --help` lists them) on Ray with the plan's device groups, "
                    "colocation and parallel configs. Models without a path are the built-in tiny policy, warmed up "
                    "on the built-in task the first time (cached in $HFLOW_CACHE or ~/.cache/hybridflow).")
    p.add_argument("plan", help="plan file (JSON or YAML), e.g. from `hflow-plan search --out plan.json`")
    p.add_argument("--iterations", type=positive_int, default=10, metavar="N", help="iterations to run (default 10)")
    p.add_argument("--address", help="Ray cluster to join ('auto', 'ip:port'); default: a new local cluster")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line of metrics per iteration")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save a checkpoint after every iteration here")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--config", metavar="RUN.yaml", help="RL settings (RunConfig fields: actor_lr, kl, loss, task, ...; unset ones take "
                   "the algorithm's defaults)")
    p.add_argument("--task", help="built-in task for prompts and the warm-up policy (sort, add)")
    p.add_argument("--prompts", metavar="FILE", help="prompts from a .jsonl or .parquet file with a 'prompt' column")
    p.add_argument("--seed", type=int, help="random seed (data order, sampling, initialisation)")
    p.add_argument("--trace", metavar="FILE", help="write the measured timeline as a Chrome trace")
    p.add_argument("--timeline", metavar="FILE.png", help="write the measured timeline as a PNG Gantt chart")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of tables")
    add_profile_arg(p)
    p.set_defaults(func=run)


def run_config(args):
    from hybridflow.runtime.run_config import RunConfig
    from hybridflow.simulator.io import load_model_file

    cfg = load_model_file(RunConfig, args.config) if args.config else RunConfig()
    overrides = {k: v for k, v in (("task", args.task), ("prompts_file", args.prompts), ("seed", args.seed))
                 if v is not None}
    if overrides.get("task"):
        from hybridflow.runtime.tasks.builtin import get_task

        get_task(overrides["task"])  # one-line error for an unknown task before anything starts
    return cfg.model_copy(update=overrides)


def run(args) -> int:
    from rich.console import Console

    try:
        from hybridflow.runtime.trainer import Trainer
    except ImportError as e:
        raise HflowError(f"`run` needs the runtime extra ({e.name} is missing): pip install -e '.[runtime]'") from None
    from hybridflow.simulator.plan import Plan
    from hybridflow.tools.run_report import (
        comparison_table,
        export_timeline,
        predicted_timeline,
        run_with_progress,
    )

    if args.resume and not args.checkpoint_dir:
        raise HflowError("--resume needs --checkpoint-dir (the folder of an earlier run's checkpoints)")
    if args.timeline and Path(args.timeline).suffix.lower() != ".png":
        raise HflowError(f"{args.timeline}: the timeline picture is a PNG; give a file name ending in .png")
    plan = Plan.load(args.plan)
    cfg = run_config(args)
    settings = cfg.for_algorithm(plan.algorithm, has_ref="ref" in plan.roles)  # one-line errors before Ray starts
    predicted = predicted_timeline(*plan_with_profile(plan, args.profile), kl_in_reward=settings.kl_in_reward)
    console = Console(file=sys.stderr if args.json else sys.stdout, width=max(Console().width, 120))
    trainer = Trainer(plan, cfg, metrics_path=args.metrics, checkpoint_dir=args.checkpoint_dir, address=args.address)
    try:
        metrics = run_with_progress(trainer, args.iterations, args.resume, console, quiet=args.json)
    finally:
        trainer.shutdown()
    written = export_timeline(trainer.timeline, args.trace, args.timeline, f"{Path(args.plan).stem} (measured)")
    if args.json:
        from hybridflow.tools.run_report import measured_view

        secs, ops, _ = measured_view(trainer.timeline)
        print(json.dumps({"iterations": metrics, "measured": {"iteration_seconds": secs, "op_seconds": ops},
                          "predicted": {"iteration_seconds": predicted.iteration_seconds(),
                                        "op_seconds": predicted.op_seconds()} if predicted else None}))
        return 0
    console.print(comparison_table(predicted, trainer.timeline))
    first, last = metrics[0]["reward_mean"], metrics[-1]["reward_mean"]
    console.print(f"reward {first:.3f} → {last:.3f} over {len(metrics)} iteration(s)"
                  + (f"; wrote {', '.join(written)}" if written else ""))
    return 0
