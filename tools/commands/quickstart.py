"""`hflow-plan quickstart`: the whole system on this machine in a few minutes, with no downloads.

1. Describe this machine as a cluster (its hardware measured in seconds, then cached).
2. Search the best plan for a tiny-model RLHF run on it (the planner's Algorithm 1).
3. Run that plan for a few iterations on a local Ray cluster: the built-in digit-sorting task,
   a tiny Llama policy warmed up by a short supervised phase the first time (cached).
4. Print the plan, the reward going up, and predicted vs measured seconds.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import add_algorithm_flag, positive_int


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quickstart", help="measure this machine, plan and run a tiny RLHF job on it, reward and timings",
        description="Measure this machine (cached), search the best plan for a tiny-model RLHF run on it, run the "
                    "plan on a local Ray cluster on the built-in digit-sorting task, and print the plan, the "
                    "reward per iteration and predicted vs measured seconds per op. The first run also warms up "
                    "the tiny policy (a few minutes on 2 cores; cached after).",
        epilog=examples("hflow-plan quickstart", "hflow-plan quickstart --algo ppo --iterations 20",
                        "hflow-plan quickstart --devices 1 --seed 1 --json"))
    add_algorithm_flag(p, "grpo")
    p.add_argument("--iterations", type=at_least_two, default=40, metavar="N", help="RL iterations (at least 2)")
    p.add_argument("--devices", type=positive_int, metavar="N", help="virtual devices (default: this machine's cores)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--reprobe", action="store_true", help="measure this machine again instead of using the cached "
                   "hardware probe (it is re-measured anyway when stale or when a quick check disagrees with it)")
    p.add_argument("--eval-prompts", type=positive_int, default=64, metavar="N",
                   help="held-out prompts of the task evaluated before the first update, every 10 iterations and at "
                        "the end (0: none)")
    p.set_defaults(func=run)


def at_least_two(text: str) -> int:
    n = positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"give at least 2 to see the reward move, got '{text}'")
    return n


def quickstart_request(algorithm: str, cluster):
    from hybridflow.planner import SearchRequest
    from hybridflow.runtime.tasks.builtin import get_task
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.simulator.vocabulary.workload import Workload

    algo = get_algorithm(algorithm)
    tiny = model_preset("tiny")
    roles = ("actor", *algo.critics, "ref")  # scores are rule-based: the task's reward (and a demo cost)
    samples = 1 if algo.critics else 8  # critic-free algorithms compare samples of a prompt
    workload = Workload(prompts=256 // samples, samples_per_prompt=samples, prompt_len=16, response_len=8,
                        micro_batch_size=128, ppo_epochs=1, mini_batches=2)
    cost = "hybridflow.runtime.tasks.builtin:non_digit_cost" if "cost" in algo.scores else None
    # pp = 1: the runtime runs pipelined training, but the shipped CPU profile measures no pipeline
    # stages, so the quickstart stays where its predictions are calibrated; the runtime generates with pp_g = 1.
    return SearchRequest(algorithm=algorithm, models={r: tiny for r in roles}, cluster=cluster, workload=workload,
                         reward_function=get_task("sort").reward_function, cost_function=cost, max_pp=1,
                         max_gen_pp=1, top_k=3)


def quickstart_config(seed: int, eval_prompts: int = 0):
    """The run's settings: learning rates for the tiny model, the algorithm's defaults for the rest; with
    `eval_prompts`, that many held-out prompts of the task (another seed's) evaluated every 10 iterations."""
    from hybridflow.runtime.rl.run_config import RunConfig

    cfg = RunConfig(seed=seed, data={"task": "sort"}, optimizer={"actor": {"lr": 5e-4}, "critic": {"lr": 1e-3}})
    if not eval_prompts:
        return cfg
    return cfg.with_overrides({"eval.prompts_file": str(held_out_file("sort", eval_prompts, seed)), "eval.every": 10,
                               "eval.max_prompts": eval_prompts})


def held_out_file(task: str, count: int, seed: int):
    """`count` prompts of the built-in `task` drawn with a seed training never uses, as a JSONL file in the cache."""
    import json

    from hybridflow.runtime.controller.host import cache_dir
    from hybridflow.runtime.tasks.prompt_files import task_rows
    from hybridflow.simulator.io import write_atomic

    path = cache_dir() / f"heldout-{task}-{count}-{seed}.jsonl"
    if not path.is_file():
        rows = task_rows(task, count, seed=1_000_000 + seed)
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(args) -> int:
    from rich.console import Console

    try:
        from hybridflow.runtime.rl.resolve import resolve_run
        from hybridflow.runtime.rl.trainer import Trainer
        from hybridflow.tools.profile_option import local_pricing
    except ImportError as e:
        raise HflowError(f"quickstart needs the runtime extra ({e.name} is missing): pip install -e '.[runtime]'") from None
    from hybridflow.planner import plan_summary, scored_to_plan, search
    from hybridflow.tools.reports.comparison import Comparison, comparison_table, speed_line
    from hybridflow.tools.reports.run import (
        ConsoleEvents,
        check_plan,
        predicted_timeline,
        quick_speed_check,
        run_with_progress,
    )

    console = Console(file=sys.stderr if args.json else sys.stdout, width=max(Console().width, 120))
    events = ConsoleEvents(console, quiet=args.json)
    events.say("measuring this machine (cached after the first time)")
    # the shipped profile's calibration when this is the machine it was measured on, else the probe
    notes: list[str] = []
    cluster, cost_model, profile = local_pricing(args.devices, reprobe=args.reprobe, notes=notes)
    for note in notes:
        events.say(note)
    req = quickstart_request(args.algo, cluster)
    events.say("searching placements and parallel configs")
    result = search(req, cost_model)
    if result.best is None:
        raise HflowError(f"no plan fits {args.algo} with the tiny model on {cluster.devices_per_node} device(s)")
    plan = scored_to_plan(req, result.best, notes="hflow-plan quickstart")
    summary = plan_summary(plan, result.best.seconds)
    cfg = quickstart_config(args.seed, args.eval_prompts)
    resolved = resolve_run(plan, cfg)
    predicted = predicted_timeline(plan, cost_model, kl_in_reward=resolved.config.kl_in_reward)
    if not args.json:
        from hybridflow.tools.reports.search import top_plans_table

        hw = cluster.hardware
        console.print(f"[bold]this machine[/]: {cluster.devices_per_node} device(s) of {hw.name}: "
                      f"{hw.peak_flops / 1e9:,.1f} GFLOP/s, {hw.hbm_bandwidth / 1e9:,.1f} GB/s memory, "
                      f"{hw.intra_node_bandwidth / 1e9:,.2f} GB/s all-reduce links")
        console.print(top_plans_table([plan_summary(scored_to_plan(req, s), s.seconds) for s in result.top],
                                      title=f"best plans for {args.algo} with the tiny model (simulated)"))
    check_plan(plan, cfg, None, events)
    speed, speed_note = (quick_speed_check(profile, events) if profile else
                         (None, "no profile of this machine; the plan is priced on the hardware probe's figures"))
    trainer = Trainer(resolved, events=events)
    try:
        with events:
            metrics = run_with_progress(trainer, args.iterations, False, events)
    finally:
        trainer.shutdown()
    comparison = Comparison.from_timelines(predicted, trainer.timeline, speed, speed_note)
    iterations = [{"iteration": m["iteration"], "reward_mean": m["reward_mean"],
                   "tokens_per_second": m["tokens_per_second"], "op_seconds": m["op_seconds"]} for m in metrics]
    if args.json:
        print(json.dumps({"plan": summary, "iterations": iterations, "evaluations": trainer.eval_history,
                          "predicted": {"iteration_seconds": predicted.iteration_seconds() if predicted else None,
                                        "op_seconds": predicted.op_seconds() if predicted else {}},
                          "comparison": comparison.json()}))
        return 0
    _print_rewards(console, metrics)
    if len(trainer.eval_history) > 1:
        first, last = trainer.eval_history[0], trainer.eval_history[-1]
        console.print(f"held-out accuracy (greedy, {first['eval/prompts']} prompts the run never trains on): "
                      f"{first['eval/accuracy']:.1%} before the first update, {last['eval/accuracy']:.1%} after "
                      f"{last['iteration']} ({last['eval/accuracy'] - first['eval/accuracy']:+.1%})")
    console.print(comparison_table(comparison))
    console.print(speed_line(comparison))
    return 0


def _print_rewards(console, metrics: list[dict]) -> None:
    from rich.table import Table

    t = Table(title="reward per iteration (built-in task: sort the digits; 1 = exact)", title_justify="left")
    for col in ("iteration", "reward", "exact", "tokens/s", "seconds"):
        t.add_column(col, justify="right")
    for m in metrics:
        bar = "█" * round(20 * m["reward_mean"])
        t.add_row(str(m["iteration"]), f"{m['reward_mean']:.3f} {bar}", f"{m['success_rate']:.0%}",
                  f"{m['tokens_per_second']:,.0f}", f"{m['seconds']:.2f}")
    console.print(t)
    first, last3 = metrics[0]["reward_mean"], sum(m["reward_mean"] for m in metrics[-3:]) / len(metrics[-3:])
    console.print(f"reward: first iteration {first:.3f}, mean of the last three {last3:.3f} ({last3 - first:+.3f})")
