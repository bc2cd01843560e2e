"""The async mode with and without partial rollouts on a long tail of response lengths, measured and
predicted (issue 34, item 4).

    python -m hybridflow.tools.bench.partial_rollouts [--iterations 24] [--repeats 1] [--prompts 4] [--samples 4]
        [--mean 64] [--response-len 512] [--budget auto|N] [--staleness 4] [--temperature 1.5]
        [--natural-lengths] [--model tiny|p256] [--profile cpu-2core] [--seed 0] [--no-speed-check] [--json]
    python -m hybridflow.tools.bench.partial_rollouts --predict      # the simulator alone, a few long-tail shapes

The regime partial rollouts are for: the rollout is the longer side and its tail decodes at a small batch —
reasoning RL on GPUs, where generation is most of an iteration and a decode step costs about the same at
1 row as at 64 (memory-bound). This CPU's decode is compute-bound at a full batch, but at a few rows a step
costs its fixed part (about 0.3 ms for the tiny model), so a call of 8 rows whose longest response runs 8×
the mean is step-bound the way a GPU's tail is. The default workload: the async plan of
tools/bench/async_modes.py (the tiny GRPO sort task on 2 devices: trainers on one, the rollout on the other)
with 4 prompts × 4 responses per batch (two calls of 8 rows), trained without the reference model (GRPO
without its KL term, as DAPO runs it), one epoch, packed micro-batches, staleness bound k = `--staleness`,
sampled at `--temperature`; each response's length imposed from the maximum-entropy distribution of mean
`--mean` and maximum `--response-len` (8×; shortest 8, room for the answer): every batch's worth of
prompts, in draw order, gets that distribution's quantiles, the longest among them, shuffled with the seed
(`ImposedLengths`) — the rollout engine's per-row `lengths` (exactly that many tokens, EOS not ending a
response: vLLM's `max_tokens` with `ignore_eos`, how serving benchmarks impose output lengths;
engines/rollout/generation.py). The tokens past a response's first EOS stay in the sequence (every
trainer pass computes them) and out of the loss (`response_mask` 0, as a tool's output in an agent run), so
the reward, the advantages and the loss read the policy's answer and the task stays learnable.

Run twice on the same data and seed: every response in one call, then with
`async_mode.partial_rollout_tokens` = `--budget` (runtime/rl/partial_rollouts.py; `auto`, the default: of the
longest over 2 … k rounds, the budget the simulator prices fastest on the imposed lengths, printed with every
price — simulator/schedule/schedule.py fastest_partial_budget). Per run: the measured
steady iteration (the Timeline's), each side's busy seconds per iteration after the first (`busy_sides`), the
prediction (the simulator with the profile's cost model and the imposed distribution — or, with
`--natural-lengths`, the lengths the first run recorded — and for the second the partial rollouts' rounds,
one per iteration with a weight sync before each: simulator/schedule/pipeline.py partial_rollout_workload,
sync_period), the staleness (max over iterations, bound k), the mean reward of the first and last thirds,
and the responses continued across rounds; with `--repeats` the two take turns and each side's median run
is reported, with the spread of its runs. Before each run the profile's one-device points of the tiny model are
re-timed (`hflow-plan profile --check`), and again after it (`--no-speed-check` skips both): the prediction's
error is also given at the machine's speed then (the prediction scaled by now / profiled, the geometric mean of
the two checks), since a shared machine's speed drifts between minutes.

`--natural-lengths` runs the old workload: 16 prompts × 8 responses of at most 256 tokens, the reference
model kept, lengths as the policy samples them at temperature 1.5 (mean about 13, a few rambling to the
cap). It is training-bound on this machine (a trained token costs about 0.2 ms, a generated one 0.04 ms at
a full batch), so shortening the rollout's tail cannot pay: measured 0.88–1.14× there (docs/rl.md).
`--predict` runs nothing: the simulator's price of a few tails whose maximum is 8× the mean, at 16, 4 and 2
prompts (the default workload's plan otherwise), without and with partial rollouts.
"""

from __future__ import annotations

import json
import sys

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.bench.async_modes import balance_word, bench_plans, median_run, sides, thirds
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.commands.profile import GRID_MODELS
from hybridflow.tools.flags import partial_budget_arg
from hybridflow.tools.outputs import run_main
from hybridflow.tools.reports.tables import partial_summary

PACKED_SEQUENCES = 8  # the trainers' micro-batch token budget, in longest sequences
SHORTEST = 8  # the shortest imposed response: room for the sort task's longest answer (6 digits) and its EOS
# `--predict`'s shapes: (prompts, mean response, longest response), each tail's maximum 8× its mean, the budget a
# quarter of the longest (the most rounds k = 4 allows); the default workload's is (4, 64, 512)
PREDICT_SHAPES = ((16, 16, 128), (16, 64, 512), (4, 16, 128), (4, 64, 512), (4, 128, 1024), (2, 64, 512))


def bench_plan(cluster, response_len: int, prompts: int, samples: int, staleness: int, reference: bool = True,
               model: str = "tiny"):
    """The async plan of tools/bench/async_modes.py with this workload, bound and packed micro-batches;
    `reference=False`: without the reference model (GRPO without its KL term, as DAPO runs it); `model`: one of
    the profile grid's models (GRID_MODELS) for every role."""
    from hybridflow.simulator.vocabulary.plan import Plan

    doc = bench_plans(cluster.model_dump())["async"].model_dump()
    doc["workload"].update(response_len=response_len, prompts=prompts, samples_per_prompt=samples)
    for role in doc["roles"].values():
        role["model"] = GRID_MODELS[model].model_dump()
    doc["max_staleness"] = staleness
    if not reference:
        del doc["roles"]["ref"]
    for role in doc["roles"]:  # packed micro-batches: the trainers' work follows the real tokens, not the budget
        doc["roles"][role]["micro_batch_tokens"] = PACKED_SEQUENCES * (doc["workload"]["prompt_len"] + response_len)
    return Plan.model_validate(doc).validate_parallel()


def predict_shapes(cal, cluster, samples: int, staleness: int, model: str = "tiny") -> list[dict]:
    """The simulator alone, per PREDICT_SHAPES shape: rollout : trainers and iteration seconds without and with
    partial rollouts at the budget it prices fastest (`priced_budget`) — where they can pay on this profile's
    machine."""
    from hybridflow.simulator.schedule.schedule import simulate
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    cm, rows = cal.cost_model(cluster), []
    for prompts, mean, longest in PREDICT_SHAPES:
        plan = bench_plan(cluster, longest, prompts, samples, staleness, reference=False, model=model)
        plan = plan.model_copy(update={"workload": plan.workload.model_copy(
            update={"response_lengths": LengthDistribution.max_entropy(mean, longest, shortest=SHORTEST)})})
        budget, _ = priced_budget(plan, cm)
        row = {"prompts": prompts, "mean": mean, "longest": longest, "budget": budget}
        for key, b in (("async", None), ("partial", budget)):
            t = simulate(plan, cm, iterations=3, partial_rollout_tokens=b)
            row[key] = {"seconds": t.iteration_seconds(), "rollout_trainers": sides(t, plan)}
        row["speedup"] = row["async"]["seconds"] / row["partial"]["seconds"]
        rows.append(row)
    return rows


def priced_budget(plan, cm) -> tuple[int, dict]:
    """The partial-rollout budget the simulator prices fastest for `plan` (simulator/schedule/schedule.py
    fastest_partial_budget: the longest response over 2 … k rounds), even where none beats running without them
    (the comparison is the bench's point), and every price (key None: without)."""
    from hybridflow.simulator.schedule.schedule import fastest_partial_budget, first_fastest

    _, seconds = fastest_partial_budget(plan, cm, iterations=3)  # as the bench's predictions
    return first_fastest({b: t for b, t in seconds.items() if b is not None}), seconds


class ImposedLengths:
    """The response lengths imposed on the prompts in the order they are drawn: each batch's worth of rows
    (prompts × samples, in draw order) gets the distribution's `sample` — its quantiles, the longest among
    them — in a seeded random order, so every batch holds the whole tail; the same stream for every run of a
    seed."""

    def __init__(self, dist, rows_per_batch: int, seed: int):
        self.dist, self.rows_per_batch, self.seed = dist, rows_per_batch, seed
        self.drawn = 0  # rows handed out so far

    def _block(self, b: int):
        import torch

        order = torch.randperm(self.rows_per_batch, generator=torch.Generator().manual_seed(self.seed * 7919 + b))
        return torch.tensor(self.dist.sample(self.rows_per_batch), dtype=torch.long)[order]

    def next(self, n: int):
        """The lengths of the next `n` rows drawn."""
        import torch

        first, last = self.drawn, self.drawn + n
        blocks = range(first // self.rows_per_batch, -(-last // self.rows_per_batch))
        stream = torch.cat([self._block(b) for b in blocks])
        start = first - blocks[0] * self.rows_per_batch
        self.drawn = last
        return stream[start:start + n]


def imposed_length_trainer(lengths: ImposedLengths | None):
    """The Trainer, its prompt batches carrying each row's imposed response length (the rollout engine's
    `lengths`: exactly that many tokens, EOS not ending it; engines/rollout/generation.py); None: the
    Trainer itself (the lengths the policy samples)."""
    from hybridflow.runtime.engines.rollout.generation import FORCED_LENGTH_FIELD
    from hybridflow.runtime.rl.trainer import Trainer

    if lengths is None:
        return Trainer

    class ImposedLengthTrainer(Trainer):
        def prompt_batch(self, count: int | None = None):
            batch = super().prompt_batch(count)
            batch[FORCED_LENGTH_FIELD] = lengths.next(len(batch))
            return batch

        def start(self):
            fresh = not self.groups
            super().start()
            if fresh:  # the Dataflow's rollouts, each row's tokens past its answer out of the loss
                generate, eos = self.df.generate, self.tok.eos_ids
                self.df.generate = lambda *args, **kwargs: tail_out_of_loss(generate(*args, **kwargs), eos)
            return self

    return ImposedLengthTrainer


def tail_out_of_loss(batch, eos_ids: list[int]):
    """A rollout of imposed lengths with each response's tokens after its first EOS (the answer's end) out of
    the loss — `response_mask` 0, as a tool's output in an agent run — and still in the sequence
    (`attention_mask` 1): every pass of the trainers computes them, the policy's loss, advantages and reward
    read its answer."""
    import torch

    mask = batch["response_mask"]
    ended = torch.isin(batch["responses"], torch.tensor(eos_ids)) & mask.bool()
    after = (ended.long().cumsum(1) - ended.long()) > 0  # past the first EOS (the EOS itself stays)
    batch["response_mask"] = mask * ~after
    return batch


def machine_speed(profile: str) -> float:
    """This machine's speed now against `profile`'s: all its one-device reference points re-timed (seconds now /
    then, the median; `hflow-plan profile --check`). All, not the quick form `run` makes: the quick points are the
    short ones (small batches, 16-token prompts), and on a shared VM their speed moves more than a long tail's
    work does — the long-prompt prefill and long-context decode points are this workload's regime."""
    from hybridflow.runtime.measure.profile_check import check_speed
    from hybridflow.simulator.calibration.profile import resolve_profile

    return check_speed(resolve_profile(profile)).index


def at_speed(run: dict) -> str:
    """`, X at speed S` for a run with a speed check, else nothing."""
    return "" if run.get("error_at_speed") is None else f", {run['error_at_speed']:+.0%} at speed {run['speed']:.2f}"


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


def measure(plan, config, iterations: int, lengths: ImposedLengths | None) -> dict:
    with imposed_length_trainer(lengths)(plan, config) as t:
        records = []
        for _ in range(iterations):
            m = t.step()
            records.append(m)
            print(f"  iteration {m['iteration']}: reward {m['reward_mean']:.3f}, response length (in the loss) mean "
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
    ap.add_argument("--iterations", type=int, default=24, help="iterations per run (the first is start-up)")
    ap.add_argument("--budget", type=partial_budget_arg, default="auto",
                    help="partial_rollout_tokens: new tokens per response per round, or auto (default): of the longest "
                         "response over 2 … k rounds, the one the simulator prices fastest (with --natural-lengths, "
                         "whose lengths are not known before the run: the longest / k)")
    ap.add_argument("--response-len", type=int, default=None,
                    help="the longest response (default 512; 256 with --natural-lengths)")
    ap.add_argument("--mean", type=int, default=64, help="the imposed lengths' mean (default 64: the longest is 8× it)")
    ap.add_argument("--natural-lengths", action="store_true",
                    help="impose no lengths: the responses end where the policy samples EOS (the old workload: 16 "
                         "prompts × 8 at temperature 1.5, training-bound on this machine)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (default 1.5)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per batch (default 4; 16 with --natural-lengths)")
    ap.add_argument("--samples", type=int, default=None,
                    help="responses per prompt (default 4; 8 with --natural-lengths)")
    ap.add_argument("--staleness", type=int, default=4, help="the async plan's bound k (default 4)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per side, taking turns; the median run is reported")
    ap.add_argument("--model", choices=("tiny", "p256"), default="tiny",
                    help="every role's model: tiny (default: its 4 MB of fp32 weights stay in a core's share of the L3 "
                         "between decode steps) or the profile grid's p256 (17 MB: a decode step streams them from "
                         "memory, as a GPU's does)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-speed-check", action="store_true", help="skip re-timing the profile's one-device points "
                    "before each run (the machine's speed then against the profile's: the predictions at that speed)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    ap.add_argument("--predict", action="store_true", help="run nothing: the simulator's price of a few long-tail "
                    "shapes (max 8× mean) without and with partial rollouts — where they pay on this machine")
    a = ap.parse_args(argv)
    natural = a.natural_lengths
    a.temperature = a.temperature if a.temperature is not None else 1.5
    a.prompts = a.prompts if a.prompts is not None else 16 if natural else 4
    a.samples = a.samples if a.samples is not None else 8 if natural else 4
    a.response_len = a.response_len if a.response_len is not None else 256 if natural else 512
    if a.staleness < 2:
        raise HflowError(f"--staleness {a.staleness}: give at least 2 (a paused response goes on in a later round)")
    auto = a.budget == "auto"
    a.budget = -(-a.response_len // a.staleness) if auto else a.budget  # auto, until priced: the finest cut
    if a.iterations < 3:
        raise HflowError(f"--iterations {a.iterations}: give at least 3 (the first is start-up)")
    if not 1 <= a.budget < a.response_len:
        raise HflowError(f"--budget {a.budget} must be at least 1 and below --response-len {a.response_len}")
    if a.repeats < 1:
        raise HflowError(f"--repeats {a.repeats}: give at least 1 run per side")
    if a.prompts < 2 or a.samples < 2:
        raise HflowError(f"--prompts {a.prompts} and --samples {a.samples} must be at least 2 (GRPO's groups, two chunks)")
    if a.temperature <= 0:
        raise HflowError(f"--temperature {a.temperature} must be above 0 (sampled responses)")
    if not natural and not SHORTEST < a.mean < a.response_len:
        raise HflowError(f"--mean {a.mean} must lie between {SHORTEST} (room for the answer) and --response-len "
                         f"{a.response_len}")

    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.vocabulary.lengths import LengthDistribution

    cal = calibrate_file(a.profile)
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    if a.predict:
        rows = predict_shapes(cal, cluster, a.samples, a.staleness, a.model)
        if a.json:
            print(json.dumps(rows))
            return 0
        print(f"predicted on {cal.profile}, the {a.model} model, {a.samples} responses per prompt, k = {a.staleness}, "
              "at the budget it prices fastest (the longest over 2 … k rounds):")
        for r in rows:
            (ra, ta), (rp, tp) = r["async"]["rollout_trainers"], r["partial"]["rollout_trainers"]
            print(f"  {r['prompts']:>2} prompts, mean {r['mean']:>4} max {r['longest']:>5}: rollout : trainers {ra:.3f} : "
                  f"{ta:.3f} s ({balance_word(ra, ta)}), with partial rollouts of {r['budget']} tokens {rp:.3f} : {tp:.3f} s; "
                  "iteration "
                  f"{r['async']['seconds']:.3f} → {r['partial']['seconds']:.3f} s ({r['speedup']:.2f}×)")
        return 0

    from hybridflow.runtime.controller.resource_pool import init_ray
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.simulator.schedule.schedule import simulate

    plan = bench_plan(cluster, a.response_len, a.prompts, a.samples, a.staleness, reference=natural, model=a.model)
    imposed = None if natural else LengthDistribution.max_entropy(a.mean, a.response_len, shortest=SHORTEST)
    budget_prices = None
    if auto and imposed is not None:  # the budget the simulator prices fastest on the imposed lengths
        a.budget, budget_prices = priced_budget(plan.model_copy(update={"workload": plan.workload.model_copy(
            update={"response_lengths": imposed})}), cal.cost_model(cluster))
    init_ray(num_cpus=2)
    sides_run = {"async": None, f"async + partial rollouts ({a.budget} tokens)": a.budget}
    all_runs: dict[str, list[dict]] = {name: [] for name in sides_run}
    for round_ in range(1, a.repeats + 1):  # the two take turns: a shared machine's speed drifts
        for name, budget in sides_run.items():
            speed = None if a.no_speed_check else machine_speed(a.profile)  # right before the run…
            print(f"{name}: run {round_} of {a.repeats}, {a.iterations} iterations…", file=sys.stderr)
            config = RunConfig(seed=a.seed, optimizer={"actor": {"lr": 5e-4 if natural else 2e-4}},
                               sampling={"temperature": a.temperature}, async_mode={"partial_rollout_tokens": budget})
            lengths = None if imposed is None else ImposedLengths(imposed, a.prompts * a.samples, a.seed)
            run = measure(plan, config, a.iterations, lengths)
            if speed is not None:  # and right after it: the run's speed is the two checks' geometric mean
                speed = (speed * machine_speed(a.profile)) ** 0.5
            all_runs[name].append({"budget": budget, "speed": speed, **run})
    runs = {name: {**median_run(rs), "measured_runs": [r["seconds"] for r in rs]} for name, rs in all_runs.items()}
    # the simulator's lengths: those imposed, or those the policy produced (the first run's steady iterations)
    lengths = imposed or LengthDistribution.from_recorded(next(iter(runs.values()))["lengths"])
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
        r["error"] = r["predicted"] / r["seconds"] - 1
        r["error_at_speed"] = r["predicted"] * r["speed"] / r["seconds"] - 1 if r["speed"] else None
        del r["lengths"]
    (base, part) = runs.values()
    out = {"profile": cal.profile, "imposed": imposed is not None, "response_lengths": lengths.describe(),
           "longest": lengths.longest, "mean": lengths.mean, "staleness_bound": a.staleness, "runs": runs,
           "measured_speedup": base["seconds"] / part["seconds"], "predicted_speedup": base["predicted"] / part["predicted"],
           "budget": a.budget, "budget_prices": None if budget_prices is None else
           partial_summary(a.budget, budget_prices)["iteration_seconds"]}
    if a.json:
        print(json.dumps(out))
        return 0
    how = "imposed" if imposed is not None else "as sampled"
    print(f"async GRPO, {a.model} model, 2 devices, {a.prompts} prompts × {a.samples} responses at temperature "
          f"{a.temperature}, lengths {how}: {out['response_lengths']} (longest {lengths.longest}, "
          f"{lengths.longest / lengths.mean:.1f}× the mean); staleness bound k = {a.staleness}")
    if budget_prices is not None:
        print(f"  budget {a.budget} tokens: the fastest the simulator prices of the longest over 2 … k rounds "
              f"({', '.join(f'{b} {t:.3f} s' for b, t in out['budget_prices'].items())})")
    for name, r in runs.items():
        spread = f" ({min(r['measured_runs']):.3f}–{max(r['measured_runs']):.3f})" if a.repeats > 1 else ""
        print(f"  {name:<36} measured {r['seconds']:6.3f} s/iteration{spread}, predicted {r['predicted']:6.3f} s "
              f"({r['error']:+.0%}{at_speed(r)}); staleness max {r['staleness']:.0f} (bound {a.staleness}: "
              f"{'held' if r['staleness_held'] else 'BROKEN'}); reward {r['reward_first_third']:.3f} → "
              f"{r['reward_last_third']:.3f} ({'rising' if r['reward_rose'] else 'NOT rising'}); continued "
              f"{r['continued']:.0f}, restarted {r['restarted']:.0f}, dropped groups {r['dropped_groups']:.0f}")
        print(f"  {'':<36} rollout : trainers per iteration, measured {r['rollout_seconds']:.3f} : "
              f"{r['trainer_seconds']:.3f} s ({r['balance']}), predicted {r['predicted_rollout_seconds']:.3f} : "
              f"{r['predicted_trainer_seconds']:.3f} s ({r['predicted_balance']})")
    print(f"  partial rollouts: {out['measured_speedup']:.2f}× measured, {out['predicted_speedup']:.2f}× predicted")
    if base["predicted_rollout_seconds"] <= base["predicted_trainer_seconds"]:  # they shorten the rollout side only
        print("  the rollout is not the longer side (predicted): cutting its tail cannot shorten the iteration "
              "(docs/rl.md)")
    return 0


if __name__ == "__main__":
    run_main(main)
