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
from hybridflow.runtime.rl.checkpoint_lock import CheckpointLock
from hybridflow.runtime.rl.checkpoint_manifest import resume_point
from hybridflow.runtime.rl.checkpoints import latest_name
from hybridflow.runtime.rl.loggers import close_loggers, open_loggers, parse_logger_names
from hybridflow.runtime.rl.run_config import CheckpointConfig, ClusterConfig, DataConfig, RunConfig
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import (
    add_profile_arg,
    add_role_flags,
    mode_arg,
    non_negative_int,
    parse_overrides,
    positive_float,
    positive_int,
    role_values,
    rollout_arg,
    task_arg,
)
from hybridflow.tools.preflight.inputs import check_inputs
from hybridflow.tools.profile_option import plan_with_profile
from hybridflow.tools.task_options import (
    add_task_flags,
    config_overrides,
    one_sample_group,
    plan_overrides,
    resumed_iterations,
)

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
                    "restart left); 4: the environment failed the run (no space left, a storage error); 130: "
                    "interrupted; 143: stopped by SIGTERM after saving (--preempt-grace).",
        epilog=examples("hflow-plan run examples/plans/tiny-local.json --profile cpu-2core --metrics run.jsonl "
                        "--timeline run.png",
                        "hflow-plan run plan.json --address auto --checkpoint-dir /shared/ckpt --keep-last 2 --resume "
                        "--max-restarts 2 --call-timeout 1800",
                        "hflow-plan run plan.json --actor ./my-sft-model --export-hf trained"))
    p.add_argument("plan", help="plan file (JSON or YAML), e.g. from `hflow-plan search --out plan.json`")
    p.add_argument("--iterations", type=positive_int, default=10, metavar="N",
                   help="iterations to run; with --resume the total to reach (--more N: N after the checkpoint)")
    p.add_argument("--address", help="Ray cluster to join ('auto', 'ip:port') (default: a new local cluster)")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="append one JSON line of metrics per iteration")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save a checkpoint here every save_every iterations")
    p.add_argument("--export-hf", metavar="DIR", help="write the trained actor (and critic) as Hugging Face folders: "
                   "DIR/actor, DIR/critic at the end, and DIR/iter_N/… with every checkpoint")
    add_role_flags(p, "FOLDER", lambda r: f"the {r}'s HF model folder (overrides the plan's path)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--keep-last", type=positive_int, metavar="N",
                   help="complete checkpoints to keep; older ones are deleted once a newer one is complete "
                        f"(default: {CheckpointConfig.model_fields['keep_last'].default})")
    p.add_argument("--start-timeout", type=positive_float, metavar="S",
                   help="seconds each start stage of a worker group may take: placement, processes, each role's "
                        f"weights (default: {ClusterConfig.model_fields['start_timeout_s'].default:g})")
    p.add_argument("--call-timeout", type=positive_float, metavar="S",
                   help="seconds one call (generate, update, …) may take before the run ends naming the late rank "
                        "(exit 3); default: no limit")
    p.add_argument("--max-restarts", type=non_negative_int, metavar="N",
                   help="after a lost worker or node (or a call past --call-timeout), restart the worker groups and "
                        "resume from the last complete checkpoint, at most N times (default: 0)")
    p.add_argument("--reward-workers", type=non_negative_int, metavar="N",
                   help="score with the reward and cost functions in N worker processes, in batches (default: 0, on "
                        "the driver one sample at a time)")
    p.add_argument("--reward-timeout", type=positive_float, metavar="S",
                   help="stop a reward or cost function's call on one sample after S seconds (in a worker process: "
                        "at least one); the run ends naming the sample, unless --reward-timeout-score X")
    p.add_argument("--reward-timeout-score", type=float, metavar="X",
                   help="score a sample whose call timed out X instead of ending the run; counted in the metrics "
                        "(reward/timeouts)")
    p.add_argument("--preempt-grace", type=positive_float, metavar="S",
                   help="on SIGTERM (a job scheduler's notice): finish the current step, save a checkpoint and end "
                        "with exit code 143 within S seconds; past S the step is abandoned and the last checkpoint "
                        f"stands (default: {ClusterConfig.model_fields['preempt_grace_s'].default:g})")
    p.add_argument("--config", metavar="RUN.yaml", help="the run config: sections data, sampling, optimizer, "
                   "checkpoint, cluster, logging and the RL settings loss, kl, advantage, shaping, lagrange, value_loss "
                   "(docs/rl.md); unset RL settings take the algorithm's defaults")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="set one run-config field by its dotted path, over --config and the flags (repeatable; the "
                        "value is read as YAML), e.g. --set optimizer.actor.lr=1e-4 --set kl.coef=0.02")
    p.add_argument("--task", type=task_arg, help="built-in task for prompts and the warm-up policy: sort or add "
                   f"(default: {DataConfig.model_fields['task'].default}, or the --config file's)")
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
    add_task_flags(p)  # tools/task_options.py: --reward-function, --prompt-len, sampling, optimizer, eval, --more
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
            if args.resume:  # each checkpoint verified against its manifest, before any worker starts
                point = resume_point(ckpt, latest_name(ckpt))
                if point.checkpoint is None:
                    raise HflowError(point.none_line(ckpt))
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
    """The --config file, then the flags, then each --set: only what they set (every RL setting left
    unset takes the algorithm's default when the run is resolved)."""
    cfg = RunConfig.load(args.config) if args.config else RunConfig()
    flags = {k: v for k, v in (("data.task", args.task), ("data.prompts_file", args.prompts), ("seed", args.seed),
                               ("checkpoint.keep_last", args.keep_last), ("sampling.rollout", args.rollout),
                               ("cluster.start_timeout_s", args.start_timeout),
                               ("cluster.call_timeout_s", args.call_timeout),
                               ("cluster.max_restarts", args.max_restarts),
                               ("cluster.preempt_grace_s", args.preempt_grace),
                               ("scoring.workers", args.reward_workers), ("scoring.timeout_s", args.reward_timeout),
                               ("scoring.timeout_score", args.reward_timeout_score)) if v is not None}
    return cfg.with_overrides({**flags, **config_overrides(args), **parse_overrides(args.overrides)})


def checkpoint_iteration(args) -> int | None:
    """The iteration of the checkpoint a --resume continues from (None: not resuming, or unknown)."""
    if not (args.resume and args.checkpoint_dir):
        return None
    ckpt = Location(args.checkpoint_dir)
    point = resume_point(ckpt, latest_name(ckpt)).checkpoint  # the one the resume loads (a broken latest skipped)
    digits = point.name.rsplit("_", 1)[-1] if point is not None else ""
    return int(digits) if digits.isdigit() else None


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
    check_args(args)
    lock = CheckpointLock(args.checkpoint_dir) if args.checkpoint_dir else None
    with readable(args.checkpoint_dir or "", "--checkpoint-dir"):
        took_over = lock.acquire() if lock else None  # a second run on the folder ends here, before torch
    try:
        return _run(args, took_over)
    finally:
        if lock:
            lock.release()


def _run(args, took_over: str | None) -> int:
    from rich.console import Console

    from hybridflow.runtime.rl.resolve import resolve_run
    from hybridflow.simulator.vocabulary.plan import Plan
    from hybridflow.tools.outputs import rendered_outputs, write_outputs
    from hybridflow.tools.preflight.partial_budget import with_partial_budget
    from hybridflow.tools.preflight.role_folders import resolve_role_paths
    from hybridflow.tools.reports.comparison import Comparison, comparison_table, speed_line
    from hybridflow.tools.reports.run import (
        ConsoleEvents,
        check_plan,
        join_cluster,
        predicted_timeline,
        quick_speed_check,
        run_with_progress,
    )

    cfg = run_config(args)
    iterations = resumed_iterations(args, checkpoint_iteration(args))  # --iterations is the total on --resume
    folders = role_values(args)  # --actor FOLDER … over the plan's
    plan = plan_overrides(Plan.load(args.plan), args)  # --reward-function, --prompt-len, … over the plan's
    plan = resolve_role_paths(plan, folders)
    args.profile = args.profile or plan.profile  # priced on the profile `search` priced it on
    if args.mode:
        plan = plan.with_mode(args.mode)
    if args.max_staleness is not None:
        if plan.mode != "async":
            raise HflowError(f"--max-staleness {args.max_staleness} bounds mode 'async', and the plan runs "
                             f"'{plan.mode}'; add --mode async")
        plan = plan.model_copy(update={"max_staleness": args.max_staleness})
    auto = cfg.async_mode.partial_rollout_tokens == "auto"
    cfg = with_partial_budget(plan, cfg, args.profile)  # `auto`: the budget the simulator prices fastest, or off
    budget = cfg.async_mode.partial_rollout_tokens
    resolved = resolve_run(plan, cfg)  # once: the rollout backend, parallel configs, the algorithm's defaults
    plan = resolved.plan
    console = Console(file=sys.stderr if args.json else sys.stdout, width=max(Console().width, 120))
    events = ConsoleEvents(console, quiet=args.json)
    if took_over:
        events.say(took_over)
    if auto:
        events.say(f"partial rollouts: {f'{budget} new tokens per response per round' if budget else 'off'} (auto: "
                   "the fastest the simulator prices; hflow-plan simulate --partial-rollout-tokens auto shows each)")
    checks = check_plan(plan, cfg, args.address, events)
    inputs = check_inputs(plan, resolved.config)  # every prompt row, its tokens, the reward on a row: before torch
    events.say(inputs.line(plan.workload.prompt_len, resolved.config.data.overlong))
    if problem := one_sample_group(resolved.config.advantage.estimator, plan.workload.samples_per_prompt, plan.algorithm):
        events.say(f"warning: {problem}")
    if args.profile:
        events.say(f"pricing the plan on profile '{args.profile}'")
    predicted = predicted_timeline(*plan_with_profile(plan, args.profile), kl_in_reward=resolved.config.kl_in_reward,
                                   partial_rollout_tokens=budget)
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
    trainer = Trainer(resolved, metrics_path=args.metrics, checkpoint_dir=args.checkpoint_dir, address=args.address,
                      events=events, export_dir=args.export_hf)
    trainer.loggers = open_loggers(args.logger_names, run_name=Path(args.plan).stem, tensorboard_dir=args.tensorboard,
                                   params={"plan": args.plan, "algorithm": plan.algorithm, **resolved.config.model_dump()})
    exported: list[str] = []
    try:
        with events:
            if args.address:
                join_cluster(args.address, checks, events)
            metrics = run_with_progress(trainer, iterations, args.resume, events)
            if args.export_hf:
                events.say(f"writing the trained models as Hugging Face folders in {args.export_hf}")
                exported = [str(p) for p in trainer.export_hf()]
    finally:
        trainer.shutdown()
        close_loggers(trainer.loggers)
    if resolved.config.agent.enabled:  # conversations: the rollout priced multi-turn on what the run showed
        from hybridflow.tools.reports.agent_prediction import multi_turn_prediction

        predicted = multi_turn_prediction(plan, args.profile, resolved.config, metrics) or predicted
    comparison = Comparison.from_timelines(predicted, trainer.timeline, speed, speed_note)
    written = exported + write_outputs(rendered_outputs(trainer.timeline, f"{Path(args.plan).stem} (measured)",
                                                        trace=args.trace, png=args.timeline))
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
