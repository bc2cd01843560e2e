"""Reward curves of every registered algorithm on the built-in task, one line per algorithm, in one PNG.

    python -m hybridflow.tools.bench.algorithms [--iterations 30] [--prompts 32] [--samples 4]
        [--algos grpo,ppo,...] [--seed 0] [--out docs/algorithms.png] [--json FILE]

Each algorithm trains the warmed-up tiny policy (the one `hflow-plan quickstart` uses) on the `sort`
task for the same number of iterations, from the same start, with its own default settings
(simulator/algorithms/) and the quickstart's learning rates: prompts × samples responses per
iteration for the critic-free ones (which compare the samples of a prompt), the same number of
responses as one sample each of prompts × samples prompts for those with critics; two optimizer
steps per iteration; the rule-based reward (and, for Safe-RLHF, the demo cost of non-digit
characters). All roles share one device. The curve is the mean reward of each iteration's rollout
(before any filter: DAPO's dynamic sampling keeps only the groups it trains on, not those it
generated), averaged over a window of 5 iterations (the raw values faint behind): every algorithm
sees the same prompts in an iteration, so their ups and downs are the prompts' difficulty. One
seed, a few dozen iterations: the curves show each algorithm learning, not a ranking.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

from hybridflow.simulator.algorithms import algorithm_names, get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.tools.flags import positive_int
from hybridflow.tools.outputs import run_main, write_outputs

TASK = "sort"
COST_FUNCTION = "hybridflow.runtime.tasks.builtin:non_digit_cost"
SMOOTH = 5  # iterations averaged in a plotted point


def bench_plan(name: str, prompts: int, samples: int):
    from hybridflow.runtime.tasks.builtin import get_task
    from hybridflow.simulator import (
        ClusterSpec,
        Device,
        DeviceGroup,
        ParallelConfig,
        Plan,
        RolePlan,
        Workload,
    )
    from hybridflow.simulator.vocabulary.model import model_preset

    algo = get_algorithm(name)
    per_prompt = 1 if algo.critics else samples
    workload = Workload(prompts=prompts * samples // per_prompt, samples_per_prompt=per_prompt, prompt_len=16,
                        response_len=10, micro_batch_size=64, mini_batches=2)
    roles = {r: RolePlan(model=model_preset("tiny"), group="g0", train=ParallelConfig())
             for r in ("actor", *algo.critics, "ref")}
    # the cluster only bounds the plan's devices (nothing is simulated here)
    return Plan(algorithm=name, cluster=ClusterSpec(hardware="a100-80g", nodes=1, devices_per_node=1),
                workload=workload, groups=[DeviceGroup(name="g0", devices=[Device(node=0, index=0)])], roles=roles,
                reward_function=get_task(TASK).reward_function,
                cost_function=COST_FUNCTION if "cost" in algo.scores else None, notes="algorithms benchmark")


def run_algorithm(name: str, args) -> list[float]:
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    cfg = RunConfig(seed=args.seed, data={"task": TASK}, optimizer={"actor": {"lr": 5e-4}, "critic": {"lr": 1e-3}})
    with Trainer(bench_plan(name, args.prompts, args.samples), cfg) as trainer:
        rewards = []
        for _ in range(args.iterations):
            rewards.append(trainer.step()["reward_mean"])
            print(f"{name}: iteration {len(rewards)} reward {rewards[-1]:.3f}", file=sys.stderr)
    return rewards


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value and the (up to) window − 1 before it."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def curves_png(curves: dict[str, list[float]], title: str) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    styles = ("-", "--", "-.", ":")
    for i, (name, rewards) in enumerate(curves.items()):
        x = range(1, len(rewards) + 1)
        raw = ax.plot(x, rewards, linewidth=0.6, alpha=0.25)[0]
        ax.plot(x, moving_average(rewards, SMOOTH), styles[i // 10 % len(styles)], color=raw.get_color(),
                label=name, linewidth=1.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"mean reward of the rollout ({SMOOTH}-iteration average)")
    ax.set_title(title, fontsize=10)
    ax.grid(color="#dddddd", linewidth=0.5)
    ax.legend(fontsize=8, loc="lower right", ncol=2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="algorithms", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=positive_int, default=30, help="iterations per algorithm (default 30)")
    ap.add_argument("--prompts", type=positive_int, default=32, help="prompts per iteration (default 32)")
    ap.add_argument("--samples", type=positive_int, default=4, help="samples per prompt, critic-free (default 4)")
    ap.add_argument("--algos", help="comma-separated algorithms (default: every registered one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/algorithms.png", help="the PNG (default docs/algorithms.png)")
    ap.add_argument("--json", metavar="FILE", help="also write the curves as JSON")
    args = ap.parse_args(argv)
    names = args.algos.split(",") if args.algos else list(algorithm_names())
    for n in names:
        get_algorithm(n)  # one-line error for a name the registry does not know
    if not args.out.lower().endswith(".png"):
        raise HflowError(f"{args.out}: the picture is a PNG; give a file name ending in .png")
    if args.samples < 2 and any(not get_algorithm(n).critics for n in names):
        raise HflowError("--samples must be at least 2: the critic-free algorithms compare the samples of a prompt")
    import ray

    from hybridflow.runtime.controller.resource_pool import init_ray

    init_ray(num_cpus=2)  # one local Ray cluster for every algorithm's trainer
    try:
        curves = {n: run_algorithm(n, args) for n in names}
    finally:
        ray.shutdown()
    title = (f"{TASK} task, tiny model: {args.prompts * args.samples} responses per iteration, "
             f"seed {args.seed} (python -m hybridflow.tools.bench.algorithms)")
    outputs = [(args.out, curves_png(curves, title))]
    summary = {n: {"first3": sum(r[:3]) / len(r[:3]), "last3": sum(r[-3:]) / len(r[-3:]), "curve": r}
               for n, r in curves.items()}
    if args.json:
        outputs.append((args.json, json.dumps(summary, indent=1) + "\n"))
    write_outputs(outputs)
    for n, s in summary.items():
        print(f"{n:>22}: mean reward of the first three iterations {s['first3']:.3f}, of the last three "
              f"{s['last3']:.3f} ({s['last3'] - s['first3']:+.3f})")
    return 0


if __name__ == "__main__":
    run_main(main)
