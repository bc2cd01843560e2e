"""`hflow-plan run PLAN`: execute a plan's RLHF algorithm on Ray, exactly as the plan places it.

Before anything starts (no torch, no Ray: a usage error takes well under a second) the arguments
and input files are checked (`check_args`), then the plan against this machine (tools/preflight/checks.py:
devices, memory, weights). Then every phase says what it does: the speed check against the
profile, Ray, the warm-up of a built-in policy, the workers, their weights, each iteration
(tools/reports/run.py). Local Ray by default (`--address` joins a cluster, whose resources are
checked once joined). Per iteration a JSON line in `--metrics` and a checkpoint in
`--checkpoint-dir` (the newest `--keep-last` kept); the measured timeline (`--trace`,
`--timeline`); sampled responses on the console and in the metrics; `--tensorboard` / `--logger`
send the metrics to those loggers too. At the end: predicted vs measured (tools/reports/comparison.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.runtime.controller.locations import Location, check_url, is_url, readable
from hybridflow.runtime.rl.checkpoints import latest_name
from hybridflow.runtime.rl.loggers import close_loggers, open_loggers, parse_logger_names
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.algorithms import ROLES, TRAINED_ROLES
from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import examples
from hybridflow.tools.commands.search import role_flag
from hybridflow.tools.outputs import (
    mode_arg,
    non_negative_int,
    positive_float,
    positive_int,
    rollout_arg,
    task_arg,
)
from hybridflow.tools.profile_option import add_profile_arg, plan_with_profile

PROMPT_SUFFIXES = (".jsonl", ".parquet")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="run a plan: RLHF iterations on Ray, measured timeline, predicted vs measured",
        description="Run PLAN's algorithm (`hflow-plan search --help` lists them) on Ray with the plan's device groups, "
                    "colocation and parallel configs. The plan is checked against this machine first (devices, "
                    "memory, model folders). Each role trains the HF folder the plan records (`search --actor "
                    "FOLDER`) or --actor FOLDER gives; models without a path are the built-in tiny policy, warmed up on the "
                    "built-in task the first time (cached in $HFLOW_CACHE or ~/.cache/hybridflow). On a cluster "
                    "(docs/cluster.md) the checkpoint, export and model folders must be on storage every node sees "
                    "(checked at start). Exit code 2: bad input; 3: a worker or node was lost or timed out (with no "
                    "restart left); 130: interrupted.",
        epilog=examples("hflow-plan run examples/plans/tiny-local.json --profile cpu-2core --metrics run.jsonl "
                        "--timeline run.png",
                        "hflow-plan run plan.json --address auto --checkpoint-dir /shared/ckpt --keep-last 2 --resume "
                        "--max-restarts 2 --call-timeout 1800",
                        "hflow-plan run plan.json --actor ./my-sft-model --export-hf trained"))
    p.add_argument("plan", help="plan file (JSON or YAML), e.g. from `hflow-plan search --out plan.json`")
    p.add_argument("--iterations", type=positive_int, default=10, metavar="N", help="iterations to run")
    p.add_argument("--address", help="Ray cluster to join ('auto', 'ip:port') (default: a new local cluster)")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line of metrics per iteration")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save a checkpoint here every save_every iterations")
    p.add_argument("--export-hf", metavar="DIR", help="write the trained actor (and critic) as Hugging Face folders: "
                   "DIR/actor, DIR/critic at the end, and DIR/iter_N/… with every checkpoint")
    for r in ROLES:
        p.add_argument(role_flag(r), dest=r, metavar="FOLDER", help=f"the {r}'s HF model folder (overrides the plan's "
                       "path)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--keep-last", type=positive_int, metavar="N",
                   help="complete checkpoints to keep; older ones are deleted once a newer one is complete "
                        f"(default: {RunConfig.model_fields['keep_last'].default})")
    p.add_argument("--start-timeout", type=positive_float, metavar="S",
                   help="seconds each start stage of a worker group may take: placement, processes, each role's "
                        f"weights (default: {RunConfig.model_fields['start_timeout_s'].default:g})")
    p.add_argument("--call-timeout", type=positive_float, metavar="S",
                   help="seconds one call (generate, update, …) may take before the run ends naming the late rank "
                        "(exit 3); default: no limit")
    p.add_argument("--max-restarts", type=non_negative_int, metavar="N",
                   help="after a lost worker or node (or a call past --call-timeout), restart the worker groups and "
                        "resume from the last complete checkpoint, at most N times (default: 0)")
    p.add_argument("--config", metavar="RUN.yaml", help="RL settings (RunConfig fields: actor_lr, kl, loss, task, ...; "
                   "unset ones take the algorithm's defaults)")
    p.add_argument("--task", type=task_arg, help="built-in task for prompts and the warm-up policy: sort or add "
                   f"(default: {RunConfig.model_fields['task'].default}, or the --config file's)")
    p.add_argument("--prompts", metavar="PATH", help="prompts from a .jsonl or .parquet file or a `datasets` folder "
                                                    "(save_to_disk) with a 'prompt' column: text or chat messages")
    p.add_argument("--seed", type=int, help="random seed: data order, sampling, initialisation "
                   f"(default: {RunConfig.model_fields['seed'].default}, or the --config file's)")
    p.add_argument("--rollout", metavar="BACKEND", type=rollout_arg,
                   help="generation engine: native or vllm (needs vLLM installed); overrides the plan's "
                        "(default: the plan's, native unless it says otherwise)")
    p.add_argument("--mode", type=mode_arg, help="sync; one-step-off: generate the next batch on the actor's "
                   "rollout devices (its generate_group) while training on this one; async: stream rollouts into a "
                   "queue of at most --max-staleness batches; overrides the plan's (default: the plan's, sync unless "
                   "it says otherwise)")
    p.add_argument("--max-staleness", metavar="K", type=positive_int,
                   help="async: the most updates a trained batch's policy may lag behind; overrides the plan's")
    p.add_argument("--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard events in DIR")
    p.add_argument("--logger", metavar="NAMES", help="also log the metrics to tensorboard, wandb (offline) and/or "
                                                     "mlflow (local file store), comma-separated")
    p.add_argument("--trace", metavar="FILE", help="write the measured timeline as a Chrome trace")
    p.add_argument("--timeline", metavar="FILE.png", help="write the measured timeline as a PNG Gantt chart")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of tables")
    add_profile_arg(p)
    p.add_argument("--no-speed-check", action="store_true",
                   help="with --profile: skip re-timing a few of the profile's points at the start (the machine's "
                        "speed now, which scales the predictions shown beside the raw ones)")
    p.set_defaults(func=run)


def _not_a_folder(path: str | None, flag: str) -> None:
    if path and Path(path).is_dir():
        raise HflowError(f"{flag} {path}: is a folder; give a file name")


def check_args(args) -> None:
    """Every argument and input-file check that needs no plan: one line each, before torch or Ray."""
    if args.resume and not args.checkpoint_dir:
        raise HflowError("--resume needs --checkpoint-dir (the folder of an earlier run's checkpoints)")
    if args.keep_last and not args.checkpoint_dir:
        raise HflowError("--keep-last needs --checkpoint-dir (the folder whose checkpoints it prunes)")
    for folder, flag in ((args.checkpoint_dir, "--checkpoint-dir"), (args.export_hf, "--export-hf")):
        if folder and is_url(folder):
            check_url(folder, flag)  # its fsspec package installed (one line naming it)
    if args.checkpoint_dir:
        with readable(args.checkpoint_dir, "--checkpoint-dir"):
            ckpt = Location(args.checkpoint_dir)
            if ckpt.is_file():
                raise HflowError(f"--checkpoint-dir {args.checkpoint_dir}: is a file; give a folder")
            if args.resume and latest_name(ckpt) is None:
                raise HflowError(f"nothing to resume in {args.checkpoint_dir}: no 'latest' checkpoint; run without "
                                 "--resume first")
    if args.timeline and Path(args.timeline).suffix.lower() != ".png":
        raise HflowError(f"{args.timeline}: the timeline picture is a PNG; give a file name ending in .png")
    for path, flag in ((args.trace, "--trace"), (args.timeline, "--timeline"), (args.metrics, "--metrics")):
        _not_a_folder(path, flag)
    if args.prompts:
        prompts = Path(args.prompts)
        if not prompts.exists():
            raise HflowError(f"--prompts {prompts}: no such prompt file or folder; give a .jsonl or .parquet file "
                             "or a `datasets` save_to_disk folder with a 'prompt' column")
        if prompts.is_file() and prompts.suffix.lower() not in PROMPT_SUFFIXES:
            raise HflowError(f"--prompts {prompts}: give a .jsonl or .parquet file or a `datasets` save_to_disk "
                             "folder with a 'prompt' column")
    check_export_dir(args.export_hf)
    if args.tensorboard and Path(args.tensorboard).is_file():
        raise HflowError(f"--tensorboard {args.tensorboard}: is a file; give a folder for the event files")
    args.logger_names = parse_logger_names(",".join(filter(None, [args.logger, args.tensorboard and "tensorboard"])))


def run_config(args) -> RunConfig:
    from hybridflow.simulator.io import load_model_file

    cfg = load_model_file(RunConfig, args.config) if args.config else RunConfig()
    overrides = {k: v for k, v in (("task", args.task), ("prompts_file", args.prompts), ("seed", args.seed),
                                   ("keep_last", args.keep_last), ("rollout", args.rollout),
                                   ("start_timeout_s", args.start_timeout), ("call_timeout_s", args.call_timeout),
                                   ("max_restarts", args.max_restarts)) if v is not None}
    # only what the file and the flags set: every RL setting left unset takes the algorithm's default
    return RunConfig.model_validate({**cfg.model_dump(exclude_unset=True), **overrides})


def check_plan(plan, cfg: RunConfig, address: str | None, events):
    """The plan against this machine (or, to join a cluster, what can be checked before joining)."""
    from hybridflow.tools.preflight.checks import RunChecks, preflight, this_machine

    checks = preflight(RunChecks(plan, None if address else this_machine(), cfg))
    events.say(f"checked the plan: {'; '.join(checks.facts)}")
    for w in checks.warnings:
        events.say(f"[yellow]warning:[/] {w}")
    return checks


def join_cluster(address: str, checks, events) -> None:
    """Join the Ray cluster at `address` and check its resources before any worker starts."""
    import ray

    from hybridflow.runtime.controller.resource_pool import init_ray
    from hybridflow.tools.preflight.checks import MACHINE_CHECKS, preflight, ray_cluster

    events.phase("ray", f"joining the Ray cluster at {address}")
    init_ray(address)
    found = preflight(checks.on(ray_cluster(ray.nodes(), address)), MACHINE_CHECKS)
    events.say(f"checked the cluster: {'; '.join(found.facts)}")
    for w in found.warnings:
        events.say(f"[yellow]warning:[/] {w}")


def check_export_dir(folder: str | None) -> None:
    """--export-hf DIR replaces DIR/actor and DIR/critic (a run's own earlier exports), nothing else."""
    if not folder:
        return
    with readable(folder, "--export-hf"):
        out = Location(folder)
        if out.is_file():
            raise HflowError(f"--export-hf {folder}: is a file; give a folder for the exported models")
        for role in TRAINED_ROLES:
            target = out / role
            if target.exists() and not (target / "config.json").is_file():
                raise HflowError(f"--export-hf {folder}: {target} exists and is not a model folder; give another "
                                 "folder")


def run(args) -> int:
    from rich.console import Console

    from hybridflow.runtime.rl.run_config import with_rollout
    from hybridflow.simulator.vocabulary.plan import Plan
    from hybridflow.tools.preflight.role_folders import resolve_role_paths
    from hybridflow.tools.reports.comparison import Comparison, comparison_table, speed_line
    from hybridflow.tools.reports.run import (
        ConsoleEvents,
        export_timeline,
        predicted_timeline,
        quick_speed_check,
        run_with_progress,
    )

    check_args(args)
    cfg = run_config(args)
    folders = {r: getattr(args, r) for r in ROLES if getattr(args, r)}  # --actor FOLDER … over the plan's
    plan = with_rollout(resolve_role_paths(Plan.load(args.plan), folders), cfg)  # rollout backend checked here too
    if args.mode:
        plan = plan.with_mode(args.mode)
    if args.max_staleness is not None:
        if plan.mode != "async":
            raise HflowError(f"--max-staleness {args.max_staleness} bounds mode 'async', and the plan runs "
                             f"'{plan.mode}'; add --mode async")
        plan = plan.model_copy(update={"max_staleness": args.max_staleness})
    console = Console(file=sys.stderr if args.json else sys.stdout, width=max(Console().width, 120))
    events = ConsoleEvents(console, quiet=args.json)
    checks = check_plan(plan, cfg, args.address, events)
    if args.profile:
        events.say(f"pricing the plan on profile '{args.profile}'")
    settings = cfg.for_algorithm(plan.algorithm, has_ref="ref" in plan.roles)  # one-line errors before Ray starts
    predicted = predicted_timeline(*plan_with_profile(plan, args.profile), kl_in_reward=settings.kl_in_reward)
    events.say("loading the runtime (torch, Ray)")
    try:
        from hybridflow.runtime.rl.trainer import Trainer
    except ImportError as e:
        raise HflowError(f"`run` needs the runtime extra ({e.name} is missing): pip install -e '.[runtime]'") from None
    speed, speed_note = None, "priced on the plan's own hardware figures; --profile NAME (a profile of this machine) " \
                              "compares with its speed now"
    if args.profile:
        speed, speed_note = (None, "--no-speed-check") if args.no_speed_check else quick_speed_check(args.profile,
                                                                                                      events)
    trainer = Trainer(plan, cfg, metrics_path=args.metrics, checkpoint_dir=args.checkpoint_dir, address=args.address,
                      events=events, export_dir=args.export_hf)
    trainer.loggers = open_loggers(args.logger_names, run_name=Path(args.plan).stem, tensorboard_dir=args.tensorboard,
                                   params={"plan": args.plan, "algorithm": plan.algorithm, **cfg.model_dump()})
    exported: list[str] = []
    try:
        with events:
            if args.address:
                join_cluster(args.address, checks, events)
            metrics = run_with_progress(trainer, args.iterations, args.resume, events)
            if args.export_hf:
                events.say(f"writing the trained models as Hugging Face folders in {args.export_hf}")
                exported = [str(p) for p in trainer.export_hf()]
    finally:
        trainer.shutdown()
        close_loggers(trainer.loggers)
    comparison = Comparison.from_timelines(predicted, trainer.timeline, speed, speed_note)
    written = exported + export_timeline(trainer.timeline, args.trace, args.timeline,
                                         f"{Path(args.plan).stem} (measured)")
    if args.json:
        print(json.dumps({"iterations": metrics,
                          "measured": {"iteration_seconds": comparison.measured_iteration,
                                       "op_seconds": comparison.measured_ops},
                          "predicted": {"iteration_seconds": predicted.iteration_seconds(),
                                        "op_seconds": predicted.op_seconds()} if predicted else None,
                          "comparison": comparison.json(),
                          **({"exported": exported} if args.export_hf else {})}))
        return 0
    console.print(comparison_table(comparison))
    console.print(speed_line(comparison))
    first, last = metrics[0]["reward_mean"], metrics[-1]["reward_mean"]
    console.print(f"reward {first:.3f} → {last:.3f} over {len(metrics)} iteration(s)"
                  + (f"; wrote {', '.join(written)}" if written else ""))
    return 0
