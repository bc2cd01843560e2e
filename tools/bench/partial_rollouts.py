"""The async mode with and without partial rollouts on a long tail of response lengths, measured and
predicted (issue 34, item 4).

    python -m hybridflow.tools.bench.partial_rollouts [--iterations 10] [--budget 64] [--response-len 256]
        [--temperature 1.5] [--prompts 16] [--samples 8] [--staleness 4] [--repeats 1] [--profile cpu-2core]
        [--seed 0] [--json]
    python -m hybridflow.tools.bench.partial_rollouts --predict      # the simulator alone, a few long-tail shapes

The async plan of tools/bench/async_modes.py (the tiny GRPO sort task on 2 devices: trainers on one, the
rollout on the other) with staleness bound `--staleness`, a response budget of `--response-len` tokens,
packed training micro-batches and sampling at `--temperature`: most responses end after a few tokens, a
few ramble on towards the budget — a heavy tail (by default mean about 13, longest about 15× that). Run twice on
the same data and seed: every response in one call, then with
`async_mode.partial_rollout_tokens` = `--budget` (runtime/rl/partial_rollouts.py). Per run: the measured
steady iteration (the Timeline's), each side's busy seconds per iteration after the first (`busy_sides`), the prediction (the simulator with the profile's cost model, the
response lengths the first run recorded as its distribution, and for the second the partial rollouts'
rounds, one per iteration with a weight sync before each: simulator/schedule/pipeline.py
partial_rollout_workload, sync_period), the staleness (max over iterations, bound
k), the mean reward of the first and last thirds, and the responses continued across rounds; with
`--repeats` the two take turns and each side's median run is reported, with the spread of its runs. Each side
says whether the staleness bound held, whether the reward rose and which side (rollout or trainers) is the
longer one: partial rollouts shorten the rollout's tail only, so they can pay only where the rollout is the
longer side. `--predict` runs nothing: the simulator's price of a few tails whose maximum is 8× the mean, at
16 and 2 prompts, without and with partial rollouts (docs/rl.md has the table and why this machine's plan
is training-bound).
"""

from __future__ import annotations

import json
import sys

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.bench.async_modes import balance_word, bench_plans, median_run, sides, thirds
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

PACKED_SEQUENCES = 8  # the trainers' micro-batch token budget, in longest sequences
# `--predict`'s shapes: (prompts, mean response, longest response), each tail's maximum 8× its mean, the budget a
# quarter of the longest (the most rounds k = 4 allows)
PREDICT_SHAPES = ((16, 16, 128), (16, 64, 512), (16, 128, 1024), (2, 64, 512), (2, 128, 1024))


def bench_plan(cluster, response_len: int, prompts: int, samples: int, staleness: int):
    """The async plan of tools/bench/async_modes.py with this workload, bound and packed micro-batches."""
    from hybridflow.simulator.vocabulary.plan import Plan

    doc = bench_plans(cluster.model_dump())["async"].model_dump()
    doc["workload"].update(response_len=response_len, prompts=prompts, samples_per_prompt=samples)
    doc["max_staleness"] = staleness
    for role in ("actor", "ref"):  # packed micro-batches: the trainers' work follows the real tokens, not the budget
        doc["roles"][role]["micro_batch_tokens"] = PACKED_SEQUENCES * (doc["workload"]["prompt_len"] + response_len)
    return Plan.model_validate(doc).validate_parallel()


def predict_shapes(cal, cluster, samples: int, staleness: int) -> list[dict]:
    """The simulator alone, per PREDICT_SHAPES shape: rollout : trainers and iteration seconds without and with
    partial rollouts — where they can pay on this profile's machine."""
    from hybridflow.simulator.schedule.schedule import simulate
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    cm, rows = cal.cost_model(cluster), []
    for prompts, mean, longest in PREDICT_SHAPES:
        plan = bench_plan(cluster, longest, prompts, samples, staleness)
        plan = plan.model_copy(update={"workload": plan.workload.model_copy(
            update={"response_lengths": LengthDistribution.max_entropy(mean, longest)})})
        row = {"prompts": prompts, "mean": mean, "longest": longest, "budget": longest // staleness}
        for key, budget in (("async", None), ("partial", longest // staleness)):
            t = simulate(plan, cm, iterations=3, partial_rollout_tokens=budget)
            row[key] = {"seconds": t.iteration_seconds(), "rollout_trainers": sides(t, plan)}
        row["speedup"] = row["async"]["seconds"] / row["partial"]["seconds"]
        rows.append(row)
    return rows


def busy_sides(timeline, plan) -> tuple[float, float]:
    """(rollout, trainers): each side's busy seconds per iteration between the end of the first iteration and the
    end of the last, by the clock. Not by the iteration an op serves, as `sides` counts: the rounds in flight that
    a partial-rollout run collects at the start of its second iteration (its start-up wave, k batches ahead)
    all serve that one."""
    actor = plan.roles["actor"]
    its = timeline.iterations()
    lo = max(e.end for e in timeline.events if e.iteration == its[0])
    hi = max(e.end for e in timeline.events if e.iteration == its[-1])

    def busy(group: str) -> float:
        return sum(max(0.0, min(e.end, hi) - max(e.start, lo)) for e in timeline.events if e.group == group)

    return busy(actor.generate_group) / (len(its) - 1), busy(actor.group) / (len(its) - 1)


def measure(plan, config, iterations: int) -> dict:
    from hybridflow.runtime.rl.trainer import Trainer

    with Trainer(plan, config) as t:
        records = []
        for _ in range(iterations):
            m = t.step()
            records.append(m)
            print(f"  iteration {m['iteration']}: reward {m['reward_mean']:.3f}, response length mean "
                  f"{m['response_length']:.1f} max {m['response_lengths']['max']:.0f}, staleness "
                  f"{m.get('staleness/max', 0):.0f}", file=sys.stderr)
    steady = records[1:]
    rollout, trainers = busy_sides(t.timeline, plan)
    return {"seconds": t.timeline.iteration_seconds(), "rollout_seconds": rollout, "trainer_seconds": trainers, "rewards": [m["reward_mean"] for m in records],
            "staleness": max(m.get("staleness/max", 0.0) for m in records),
            "continued": sum(m.get("partial/continued_responses", 0.0) for m in records),
            "restarted": records[-1].get("partial/restarted_responses", 0.0),
            "dropped_groups": records[-1].get("async/dropped_groups", 0.0),
            "lengths": [m["response_lengths"] for m in steady]}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-2core", help="profile file or shipped name (default cpu-2core)")
    ap.add_argument("--iterations", type=int, default=10, help="iterations per run (the first is start-up)")
    ap.add_argument("--budget", type=int, default=64, help="partial_rollout_tokens: new tokens per response per round")
    ap.add_argument("--response-len", type=int, default=256, help="the longest response (default 256)")
    ap.add_argument("--temperature", type=float, default=1.5, help="sampling temperature (default 1.5)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per batch (default 16)")
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt (default 8)")
    ap.add_argument("--staleness", type=int, default=4, help="the async plan's bound k (default 4)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per side, taking turns; the median run is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    ap.add_argument("--predict", action="store_true", help="run nothing: the simulator's price of a few long-tail "
                    "shapes (max 8× mean) without and with partial rollouts — where they pay on this machine")
    a = ap.parse_args(argv)
    if a.iterations < 3:
        raise HflowError(f"--iterations {a.iterations}: give at least 3 (the first is start-up)")
    if not 1 <= a.budget < a.response_len:
        raise HflowError(f"--budget {a.budget} must be at least 1 and below --response-len {a.response_len}")
    if a.repeats < 1:
        raise HflowError(f"--repeats {a.repeats}: give at least 1 run per side")
    if a.prompts < 2 or a.samples < 2:
        raise HflowError(f"--prompts {a.prompts} and --samples {a.samples} must be at least 2 (GRPO's groups, two chunks)")
    if a.temperature <= 0:
        raise HflowError(f"--temperature {a.temperature} must be above 0 (sampled responses make the long tail)")

    from hybridflow.simulator.calibration.fit import calibrate_file

    cal = calibrate_file(a.profile)
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    if a.predict:
        rows = predict_shapes(cal, cluster, a.samples, a.staleness)
        if a.json:
            print(json.dumps(rows))
            return 0
        print(f"predicted on {cal.profile}, {a.samples} responses per prompt, k = {a.staleness}, budget = longest / k:")
        for r in rows:
            (ra, ta), (rp, tp) = r["async"]["rollout_trainers"], r["partial"]["rollout_trainers"]
            print(f"  {r['prompts']:>2} prompts, mean {r['mean']:>4} max {r['longest']:>5}: rollout : trainers {ra:.3f} : "
                  f"{ta:.3f} s ({balance_word(ra, ta)}), with partial rollouts {rp:.3f} : {tp:.3f} s; iteration "
                  f"{r['async']['seconds']:.3f} → {r['partial']['seconds']:.3f} s ({r['speedup']:.2f}×)")
        return 0

    from hybridflow.runtime.controller.resource_pool import init_ray
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.simulator.schedule.schedule import simulate
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    plan = bench_plan(cluster, a.response_len, a.prompts, a.samples, a.staleness)
    init_ray(num_cpus=2)
    sides_run = {"async": None, f"async + partial rollouts ({a.budget} tokens)": a.budget}
    all_runs: dict[str, list[dict]] = {name: [] for name in sides_run}
    for round_ in range(1, a.repeats + 1):  # the two take turns: a shared machine's speed drifts
        for name, budget in sides_run.items():
            print(f"{name}: run {round_} of {a.repeats}, {a.iterations} iterations…", file=sys.stderr)
            config = RunConfig(seed=a.seed, optimizer={"actor": {"lr": 5e-4}},
                               sampling={"temperature": a.temperature}, async_mode={"partial_rollout_tokens": budget})
            all_runs[name].append({"budget": budget, **measure(plan, config, a.iterations)})
    runs = {name: {**median_run(rs), "measured_runs": [r["seconds"] for r in rs]} for name, rs in all_runs.items()}
    # the lengths the policy produced (the first run's steady iterations), as the simulator's distribution
    lengths = LengthDistribution.from_recorded(next(iter(runs.values()))["lengths"])
    priced = plan.model_copy(update={"workload": plan.workload.model_copy(update={"response_lengths": lengths})})
    cm = cal.cost_model(cluster)
    for r in runs.values():
        simulated = simulate(priced, cm, iterations=3, partial_rollout_tokens=r["budget"])
        r["predicted"] = simulated.iteration_seconds()
        r["predicted_rollout_seconds"], r["predicted_trainer_seconds"] = sides(simulated, priced)
        r["reward_first_third"], r["reward_last_third"] = thirds(r["rewards"])
        r["reward_rose"] = r["reward_last_third"] > r["reward_first_third"]
        r["staleness_held"] = r["staleness"] <= a.staleness
        r["balance"] = balance_word(r["rollout_seconds"], r["trainer_seconds"])
        r["predicted_balance"] = balance_word(r["predicted_rollout_seconds"], r["predicted_trainer_seconds"])
        del r["lengths"]
    (base, part) = runs.values()
    out = {"profile": cal.profile, "response_lengths": lengths.describe(), "longest": lengths.longest,
           "mean": lengths.mean, "staleness_bound": a.staleness, "runs": runs,
           "measured_speedup": base["seconds"] / part["seconds"], "predicted_speedup": base["predicted"] / part["predicted"]}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"async GRPO, tiny model, 2 devices, responses ≤ {a.response_len} at temperature {a.temperature}: lengths "
          f"{out['response_lengths']} (longest {lengths.longest}); staleness bound k = {a.staleness}")
    for name, r in runs.items():
        spread = f" ({min(r['measured_runs']):.3f}–{max(r['measured_runs']):.3f})" if a.repeats > 1 else ""
        print(f"  {name:<36} measured {r['seconds']:6.3f} s/iteration{spread}, predicted {r['predicted']:6.3f} s; staleness "
              f"max {r['staleness']:.0f} (bound {a.staleness}: {'held' if r['staleness_held'] else 'BROKEN'}); reward "
              f"{r['reward_first_third']:.3f} → {r['reward_last_third']:.3f} ({'rising' if r['reward_rose'] else 'NOT rising'}); "
              f"continued {r['continued']:.0f}, restarted {r['restarted']:.0f}, dropped groups {r['dropped_groups']:.0f}")
        print(f"  {'':<36} rollout : trainers per iteration, measured {r['rollout_seconds']:.3f} : "
              f"{r['trainer_seconds']:.3f} s ({r['balance']}), predicted {r['predicted_rollout_seconds']:.3f} : "
              f"{r['predicted_trainer_seconds']:.3f} s ({r['predicted_balance']})")
    print(f"  partial rollouts: {out['measured_speedup']:.2f}× measured, {out['predicted_speedup']:.2f}× predicted")
    if base["predicted_balance"] != "rollout-bound":  # they shorten the rollout side only
        print("  the plan is not rollout-bound: cutting the rollout's tail cannot shorten its iteration (docs/rl.md)")
    return 0


if __name__ == "__main__":
    run_main(main)
