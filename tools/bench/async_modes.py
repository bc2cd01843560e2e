"""Synchronous vs one-step-off vs async on separate rollout devices, predicted and measured (issue 19).

    python -m hybridflow.tools.bench.async_modes [--iterations 16] [--repeats 3] [--profile cpu-2core] [--seed 0]
        [--ops] [--no-speed-check] [--neighbour-check] [--json]

The tiny GRPO task on the same 2 devices four ways:
- `sync colocated`: actor and reference on both devices (dp 2), generation through the hybrid engine;
- `sync disaggregated`: actor and reference train on device 0, the actor generates on device 1 (the
  weights broadcast after every update);
- `one-step-off`: the same devices, the rollout of batch i+1 running while batch i trains;
- `async`: the same devices, the rollout streaming prompt groups into a queue of at most k = 2
  batches (runtime/rl/modes/streaming.py).
Per plan: the predicted iteration seconds (the simulator with the profile's cost model; a pipelined
plan's steady iteration), the measured ones (the run's Timeline, by the same definition: an
iteration's seconds from the end of the one before, since a pipelined iteration's rollout runs
inside it; simulator/vocabulary/timeline.py), the speedup over sync colocated and, for the plans on the split, over
sync disaggregated (the synchronous plan on the same devices), the staleness and the mean
reward of the first and last thirds of the run (the reward must rise in every mode: a batch of 16
prompts × 8 responses, so that one iteration's reward is not mostly sampling noise). Each plan runs
`--repeats` times, the plans taking turns (round 1 of every plan, then round 2, …): a plan's measured
seconds are the median run's, with the spread of the runs beside them, and its ops, sides, speed and
rewards are that run's — one run on a shared machine is off by its minute's speed.

The table's caption gives the two sides' balance, the rollout's seconds against the trainers' (log-probs
and update) in the synchronous disaggregated plan, predicted and measured: one step off can save at most
the shorter side. `--ops` adds, per plan, each op's predicted and measured seconds per steady iteration
(tools/reports/comparison.py's table; an op some iterations skip, async's weight sync, as its share per
iteration): where a plan's error comes from. On a shared machine compare runs made back to back, by
their ratios: its speed drifts between minutes. So before each plan a few of the profile's own
points are re-timed (`hflow-plan profile --check`'s quick form, as `run` does): `× speed` is the
machine's speed then against the profile's, and `error at speed` the error of the prediction scaled by
it (`--no-speed-check` skips it). `--neighbour-check` re-times those points on one device alone and on
both at once, back to back: the speedup of a device whose neighbour idles now, beside the profile's
alone_speedup that the prediction prices where a disaggregated plan's devices take turns
(simulator/schedule/neighbours.py, docs/rollout-devices.md).
"""

from __future__ import annotations

import json
import sys

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

WORKLOAD = {"prompts": 16, "samples_per_prompt": 8, "prompt_len": 13, "response_len": 8, "micro_batch_size": 128,
            "mini_batches": 1}
ASYNC_STALENESS = 2  # the async plan's bound k
REWARD = "hybridflow.runtime.tasks.builtin:sort_reward"
BALANCE_PLAN = "sync disaggregated"  # whose two sides (rollout, trainers) the caption weighs


def bench_plans(cluster: dict) -> dict[str, Plan]:
    """The four plans on devices 0 and 1 of `cluster`."""
    def plan(groups: dict[str, list[int]], actor: dict, ref_group: str, mode: str = "sync", reshard="hybridflow"):
        roles = {"actor": {"model": "tiny", **actor}, "ref": {"model": "tiny", "group": ref_group,
                                                             "train": {"dp": len(groups[ref_group])}}}
        return Plan.model_validate({
            "algorithm": "grpo", "cluster": cluster, "workload": WORKLOAD, "reward_function": REWARD,
            "reshard": reshard, "mode": mode, "max_staleness": ASYNC_STALENESS, "roles": roles,
            "groups": [{"name": g, "devices": [{"node": 0, "index": i} for i in d]} for g, d in groups.items()],
        }).validate_parallel()

    split = {"train": [0], "gen": [1]}
    separate = {"group": "train", "train": {"dp": 1}, "generate_group": "gen", "generate": {"dp": 1}}
    return {
        "sync colocated": plan({"all": [0, 1]}, {"group": "all", "train": {"dp": 2}}, "all"),
        "sync disaggregated": plan(split, separate, "train", reshard="broadcast"),
        "one-step-off": plan(split, separate, "train", mode="one-step-off", reshard="broadcast"),
        "async": plan(split, separate, "train", mode="async", reshard="broadcast"),
    }


def thirds(rewards: list[float]) -> tuple[float, float]:
    k = max(1, len(rewards) // 3)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def sides(timeline, plan: Plan) -> tuple[float, float]:
    """(rollout, trainers): seconds per steady iteration on the actor's generate_group and on its training
    group (a disaggregated plan's two sides; the weight sync, on both, counts in neither)."""
    actor = plan.roles["actor"]
    its = timeline.steady_iterations()
    per = {g: sum(e.seconds for e in timeline.events if e.group == g and e.iteration in its) / max(len(its), 1)
           for g in (actor.generate_group, actor.group)}
    return per[actor.generate_group], per[actor.group]


COMPARABLE = 1.5  # the longer side at most this many times the shorter: "comparable" in the caption


def balance_word(rollout: float, trainers: float) -> str:
    """Whether the two sides take comparable time, else which one is longer."""
    longer, shorter = max(rollout, trainers), min(rollout, trainers)
    if longer <= COMPARABLE * shorter:
        return "comparable"
    return "training-bound" if trainers > rollout else "rollout-bound"


def measure(plan: Plan, iterations: int, seed: int) -> dict:
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    with Trainer(plan, RunConfig(seed=seed, optimizer={"actor": {"lr": 5e-4}})) as t:
        rewards, staleness = [], []
        for _ in range(iterations):
            m = t.step()
            rewards.append(m["reward_mean"])
            staleness.append(m.get("staleness/max", 0.0))
            print(f"  iteration {m['iteration']}: reward {m['reward_mean']:.3f}", file=sys.stderr)
    return {"seconds": t.timeline.iteration_seconds(), "rewards": rewards, "staleness": max(staleness), "timeline": t.timeline}


def median_run(runs: list[dict]) -> dict:
    """The run with the median `seconds` (the lower of the middle two for an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def add_speedups(rows: list[dict]) -> None:
    """Each row's measured speedup over the synchronous colocated plan (`speedup`) and, for the plans on the
    disaggregated split, over the synchronous one on that split (`speedup_same_split`); None where the
    reference was not run."""
    measured = {r["plan"]: r["measured"] for r in rows}
    for r in rows:
        for key, ref in (("speedup", "sync colocated"), ("speedup_same_split", BALANCE_PLAN)):
            base = measured.get(ref) if key == "speedup" or r["plan"] != "sync colocated" else None
            r[key] = base / r["measured"] if base and r["measured"] else None


def neighbour_effect(profile_ref: str, passes: int = 2) -> float:
    """How many times faster a device runs with the other idle than with both busy, now: the profile's
    quick reference points re-timed both ways back to back `passes` times (runtime/measure/alone_probe.py), as
    the calibration reads the profile's own `alone` points (its alone_speedup)."""
    from hybridflow.runtime.measure.alone_probe import measure_alone
    from hybridflow.simulator.calibration.measured_terms import alone_speedup
    from hybridflow.simulator.calibration.profile import resolve_profile
    from hybridflow.tools.reports.run import SPEED_CHECK_MAX_SECONDS

    profile = resolve_profile(profile_ref)
    points = measure_alone(profile, passes=passes, max_seconds=SPEED_CHECK_MAX_SECONDS)
    return alone_speedup(profile.model_copy(update={"points": points}))


def main(argv: list[str] | None = None) -> int:
    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.schedule.schedule import simulate

    ap = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-2core", help="profile file or shipped name (default cpu-2core)")
    ap.add_argument("--iterations", type=int, default=16, help="iterations per plan (the first is start-up)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per plan, the plans taking turns; the median is "
                    "reported (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="comma-separated plan names (default: all four)")
    ap.add_argument("--ops", action="store_true", help="also each plan's ops, predicted vs measured per steady iteration")
    ap.add_argument("--no-speed-check", action="store_true",
                    help="skip re-timing a few of the profile's points before each plan (the machine's speed then "
                         "against the profile's, which scales that plan's prediction in the `× speed` columns)")
    ap.add_argument("--neighbour-check", action="store_true",
                    help="also re-time a few of the profile's points on one device alone and on both at once, "
                         "back to back: how much faster a device runs while its neighbour idles now (the profile's "
                         "alone_speedup, measured then, is what the prediction prices)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.iterations < 3:
        raise HflowError(f"--iterations {args.iterations}: give at least 3 (the first is start-up; the reward "
                         "is compared between the first and last thirds)")
    if args.repeats < 1:
        raise HflowError(f"--repeats {args.repeats}: give at least 1 run per plan")
    cal = calibrate_file(args.profile)
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    cm = cal.cost_model(cluster)
    plans = bench_plans(cluster.model_dump())
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in plans]
        if unknown:
            raise HflowError(f"--only: unknown plan '{unknown[0]}'; plans: {', '.join(plans)}")
        plans = {n: plans[n] for n in args.only.split(",")}
    simulated = {n: simulate(p, cm, iterations=3) for n, p in plans.items()}
    predicted = {n: tl.iteration_seconds() for n, tl in simulated.items()}

    from hybridflow.runtime.controller.resource_pool import init_ray

    init_ray(num_cpus=2)
    from rich.console import Console

    from hybridflow.tools.reports.comparison import Comparison, error
    from hybridflow.tools.reports.run import ConsoleEvents, quick_speed_check

    runs: dict[str, list[dict]] = {name: [] for name in plans}
    for round_ in range(1, args.repeats + 1):
        for name, plan in plans.items():
            # the machine's speed right before this run: a shared machine's drifts between minutes
            speed, speed_note = (None, "--no-speed-check") if args.no_speed_check else \
                quick_speed_check(args.profile, ConsoleEvents(Console(stderr=True), quiet=True))
            print(f"{name}: run {round_} of {args.repeats}, {args.iterations} iterations…", file=sys.stderr)
            runs[name].append({**measure(plan, args.iterations, args.seed), "speed": speed, "speed_note": speed_note})
    rows, comparisons, balance = [], {}, {}
    for name, plan in plans.items():
        m, seconds = median_run(runs[name]), [r["seconds"] for r in runs[name]]
        speed = m["speed"]
        first, last = thirds(m["rewards"])
        rows.append({"plan": name, "predicted": predicted[name], "measured": m["seconds"],
                     "measured_runs": seconds, "error": error(predicted[name], m["seconds"]), "speed": speed,
                     "error_at_speed": error(predicted[name] * speed, m["seconds"]) if speed else None,
                     "staleness": max(r["staleness"] for r in runs[name]), "reward_first_third": first,
                     "reward_last_third": last, "rewards": m["rewards"]})
        its = m["timeline"].steady_iterations()
        comparisons[name] = Comparison(predicted[name], simulated[name].op_seconds(), m["seconds"],
                                       m["timeline"].op_seconds(), plan.workload.tokens_per_iteration,
                                       f"{name}: per steady iteration, iterations {its[0]}–{its[-1]}, the median "
                                       "run", speed, m["speed_note"])
        if name == BALANCE_PLAN:
            balance = {"predicted": sides(simulated[name], plan), "measured": sides(m["timeline"], plan)}
    add_speedups(rows)
    alone = neighbour_effect(args.profile) if args.neighbour_check else None
    if args.json:
        out = {"profile": cal.profile, "workload": WORKLOAD, "plans": rows,
               "balance": {k: dict(zip(("rollout", "trainers"), v, strict=True)) for k, v in balance.items()},
               "alone_speedup_now": alone,
               "alone_speedup_profile": cal.overheads.alone_speedup}
        if args.ops:
            out["ops"] = {n: c.json() for n, c in comparisons.items()}
        print(json.dumps(out))
        return 0
    from rich.table import Table

    t = Table(title=f"GRPO, tiny model, 2 devices, {WORKLOAD['prompts']}×{WORKLOAD['samples_per_prompt']} responses, "
                    f"profile '{cal.profile}'")
    checked = any(r["speed"] for r in rows)
    for col in ("plan", "predicted s", f"measured s, median of {args.repeats} (spread)", "error", *(("× speed", "error at speed") if checked else ()),
                "× sync colocated", "× sync, same split", "staleness", "reward first → last"):
        t.add_column(col, justify="left" if col == "plan" else "right")

    def pct(e):
        return f"{e:+.1%}" if e is not None else "-"

    for r in rows:
        at_speed = (f"{r['speed']:.2f}" if r["speed"] else "-", pct(r["error_at_speed"])) if checked else ()
        spread = f" ({min(r['measured_runs']):.3f}–{max(r['measured_runs']):.3f})" if args.repeats > 1 else ""
        t.add_row(r["plan"], f"{r['predicted']:.3f}", f"{r['measured']:.3f}{spread}", pct(r["error"]), *at_speed,
                  *(f"{r[k]:.2f}" if r[k] else "-" for k in ("speedup", "speedup_same_split")), f"{r['staleness']:.0f}",
                  f"{r['reward_first_third']:.3f} → {r['reward_last_third']:.3f}")
    if balance:
        t.caption = "rollout : trainers " + ", ".join(
            f"{k} {g:.3f} s : {tr:.3f} s (1 : {tr / g:.1f}, {balance_word(g, tr)})" for k, (g, tr) in balance.items()
            if g) + f" per iteration in '{BALANCE_PLAN}'; one step off hides at most the shorter side"
        t.caption_justify = "left"
    if alone is not None:
        t.caption = (t.caption or "") + f"\none device alone runs {alone:.2f}× as fast as with both busy now; " \
            f"the profile's alone_speedup, which the prediction prices: {cal.overheads.alone_speedup:.2f}×"
        t.caption_justify = "left"
    console = Console(width=max(Console().width, 150))
    console.print(t)
    if args.ops:
        from hybridflow.tools.reports.comparison import comparison_table

        for c in comparisons.values():
            console.print(comparison_table(c))
    return 0


if __name__ == "__main__":
    run_main(main)
