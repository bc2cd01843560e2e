"""How well does the profile-calibrated simulator predict real iterations? (issue 7)

For several plans of one tiny-model PPO run on this machine's local cluster — all colocated
(data- and tensor-parallel), actor+ref apart from critic+reward, one more split, and (where
megatron-core is installed) colocated tp 2 with the actor and critic on the Megatron engine — plus the plan
the planner picks with the same calibrated cost model, run a few iterations each on the runtime
(Ray, gloo) and predict each with the shipped profile. Prints per plan: predicted / measured
iteration seconds and the error; per op kind the errors over all plans; and whether the
planner's pick is the fastest measured (or within 5 %). Targets: median iteration error ≤ 10 %,
each op kind ≤ 25 %.

    python -m hybridflow.tools.bench.sim_accuracy [--iterations 4] [--rounds 3] [--profile cpu-2core]
        [--no-speed-check] [--json]

The machine's speed drifts (a shared VM: the same profile jobs run up to 1.2× slower within the
hour), and a profile records it at one moment. So each round first re-times some of the shipped
profile's own points (runtime/measure/profile_check.py: the tiny model's one-device train, forward and
generate jobs, on the same profiler), and the table also prints the predictions scaled by the
median ratio measured / profiled, with their error: the model's error apart from the machine's
drift. `--no-speed-check` skips it.

Measured iteration seconds are the span of the iteration's ops in the runtime's Timeline (first
op start to last op end, as `hflow-plan run` reports them); the first iteration of each plan
(start-up, first-call costs) is left out. The plans run one at a time on one Ray cluster, all of
them in turn for `--rounds` rounds, each round in its own order (rows of a Williams Latin square),
so a stretch of load on the shared machine, or a slot in the round, does not fall on one plan
only; each plan's spread (median absolute deviation of its iteration seconds) is printed, and the
pick is compared with the fastest plan round by round too. The reward model is the warmed
policy's backbone with a seeded random scalar head (scoring_reward_model), so the run learns as a
real one does: its updates have real gradients.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from hybridflow.runtime.measure.profile_check import SpeedCheck, check_speed
from hybridflow.simulator.calibration.profile import Profile
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

TINY = "tiny"
# The runtime's PolicyWorker switches layouts with the plan's reshard mode (engines/rollout/hybrid.py); under
# FSDP it first all-gathers each tensor-parallel shard over dp, in every mode. The plans use the
# 3D-HybridEngine's own grouping, and the profiled cost model prices what the engines do.
RESHARD = "hybridflow"
# prompt_len: the longest "sort NNNNNN:" prompt with its BOS (the runtime pads to the batch's longest);
# response_len: up to 6 sorted digits and EOS, so most rollouts run (nearly) all 8 steps.
WORKLOAD = {"prompts": 16, "prompt_len": 13, "response_len": 8, "micro_batch_size": 8, "mini_batches": 2}


def _plan(cluster: dict, groups: dict[str, list[int]], roles: dict[str, tuple[str, dict]], gen: dict | None = None,
          notes: str = "") -> Plan:
    doc = {"algorithm": "ppo", "cluster": cluster, "reshard": RESHARD, "workload": WORKLOAD, "notes": notes,
           "groups": [{"name": g, "devices": [{"node": 0, "index": i} for i in devs]} for g, devs in groups.items()],
           "roles": {r: {"model": TINY, "group": g, "train": par} for r, (g, par) in roles.items()}}
    if gen:
        doc["roles"]["actor"]["generate"] = gen
    return Plan.model_validate(doc).validate_parallel()


def candidate_plans(cluster: dict, megatron: bool | None = None) -> dict[str, Plan]:
    """The FSDP plans, and (`megatron`; default: where megatron-core is installed) one whose actor and
    critic train on megatron-core at tp 2 (colocated megatron roles share one tp: megatron's parallel
    state is per process), priced by the profile's megatron_* terms."""
    dp2, tp2, one = {"dp": 2}, {"tp": 2}, {}
    four = ("actor", "ref", "critic", "reward")
    plans = {
        "colocated dp2": _plan(cluster, {"all": [0, 1]}, {r: ("all", dp2) for r in four}),
        "colocated tp2, gen dp2": _plan(cluster, {"all": [0, 1]}, {r: ("all", tp2) for r in four},
                                        gen={"tp": 1, "dp": 2}),
        "actor+ref | critic+reward": _plan(cluster, {"actor-ref": [0], "critic-reward": [1]},
                                           {"actor": ("actor-ref", one), "ref": ("actor-ref", one),
                                            "critic": ("critic-reward", one), "reward": ("critic-reward", one)}),
        "actor+ref+reward | critic": _plan(cluster, {"arw": [0], "critic": [1]},
                                           {"actor": ("arw", one), "ref": ("arw", one), "reward": ("arw", one),
                                            "critic": ("critic", one)}),
    }
    if _megatron_installed() if megatron is None else megatron:
        meg = {"tp": 2, "backend": "megatron"}
        plans["colocated tp2, megatron actor+critic"] = _plan(
            cluster, {"all": [0, 1]}, {"actor": ("all", meg), "critic": ("all", meg), "ref": ("all", tp2),
                                       "reward": ("all", tp2)}, gen={"tp": 1, "dp": 2})
    return plans


def _megatron_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def planner_pick(cluster, cm) -> Plan:
    from hybridflow.planner.plans import scored_to_plan
    from hybridflow.planner.request import SearchRequest
    from hybridflow.planner.search import search
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.simulator.vocabulary.workload import Workload

    req = SearchRequest.for_algorithm("ppo", model_preset(TINY), cluster, Workload(**WORKLOAD), max_pp=1)
    result = search(req, cm)
    return scored_to_plan(req, result.top[0], reshard=RESHARD)


def same_layout(a: Plan, b: Plan) -> bool:
    def key(p: Plan):
        return (sorted(sorted(r) for r in p.placement()),
                sorted((r, rp.train.label(), len(p.group(rp.group).devices)) for r, rp in p.roles.items()),
                p.generation_config().label())
    return key(a) == key(b)


def scoring_reward_model(policy: Path, out: Path, seed: int = 0) -> Path:
    """A reward model that scores: the policy's backbone with a seeded random scalar head (std
    1/sqrt(hidden), so scores spread about ±1), saved to `out`. Not the critic's zero head: that
    scores every response 0, so advantages, returns and every gradient are 0, nothing is learned,
    and the updates are not the ones a real run makes (on CPU, AdamW's sqrt over all-zero second
    moments alone makes each update ~10 % slower)."""
    import torch

    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.workers.common import load_score_model

    model = load_score_model(policy)
    head = model.score.weight
    with torch.no_grad():
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)) * head.shape[-1] ** -0.5)
    return save_pretrained(model, out)


def _with_reward_model(plan: Plan, root: Path) -> Plan:
    """The plan with a scoring reward model built on its actor's warmed policy (one per policy, under `root`)."""
    from hybridflow.runtime.models.hf_format import CONFIG_FILE
    from hybridflow.runtime.tasks.warmup import WarmupConfig, warm_policy

    policy = warm_policy(plan.roles["actor"].model, WarmupConfig(task="sort", seed=0))
    reward = root / f"reward-{policy.name}"
    if not (reward / CONFIG_FILE).is_file():
        scoring_reward_model(policy, reward)
    roles = {r: rp.model_copy(update={"path": str(reward)}) if r == "reward" else rp for r, rp in plan.roles.items()}
    return plan.model_copy(update={"roles": roles})


def round_order(names: list[str], round_index: int) -> list[str]:
    """The plans' order in round `round_index`: row `round_index` of a Williams Latin square (offsets 0,
    1, −1, 2, −2, … from the round's first plan), so over the rounds every plan runs in every slot and
    after different plans — no plan always runs first, last, or right after the same one."""
    n = len(names)
    offsets = [0] + [(j + 1) // 2 if j % 2 else -(j // 2) for j in range(1, n)]
    return [names[(round_index + o) % n] for o in offsets] if n else []


def measure_rounds(plans: dict[str, Plan], iterations: int, rounds: int = 3, on_run=None,
                   speed_profile: Profile | None = None) -> tuple[dict[str, dict], list[SpeedCheck]]:
    """Run every plan alone on one Ray cluster for `iterations` iterations, and all of them again
    `rounds` times over, each round in its own order (round_order), so a stretch of load on the
    shared machine, or a slot in the round, does not fall on one plan only. Per plan: the median
    iteration seconds over every round's iterations 2..N (the first of each run is start-up), its
    spread (median absolute deviation), the per-round medians, and the median seconds per op; and,
    with `speed_profile`, each round's speed check (check_speed, run first in the round)."""
    import ray

    from hybridflow.runtime.controller.resource_pool import init_ray
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    devices = max(sum(len(g.devices) for g in p.groups) for p in plans.values())
    owns = not ray.is_initialized()
    init_ray(num_cpus=devices)
    reward_root = Path(tempfile.mkdtemp(prefix="hflow-reward-"))
    secs: dict[str, list[float]] = {n: [] for n in plans}
    per_round: dict[str, list[float]] = {n: [] for n in plans}
    ops: dict[str, dict[str, list[float]]] = {n: {} for n in plans}
    speed: list[SpeedCheck] = []
    try:
        for r in range(rounds):
            if speed_profile is not None:
                speed.append(check_speed(speed_profile, devices))
            for name in round_order(list(plans), r):
                plan = plans[name]
                if on_run:
                    on_run(name, r)
                with Trainer(_with_reward_model(plan, reward_root), RunConfig(seed=0)) as trainer:
                    trainer.run(iterations)
                    tl = trainer.timeline
                its = tl.iterations()[1:] or tl.iterations()
                these = [tl.iteration_seconds(i) for i in its]
                secs[name] += these
                per_round[name].append(statistics.median(these))
                for i in its:
                    for op, v in tl.op_seconds(i).items():
                        ops[name].setdefault(op, []).append(v)
    finally:
        shutil.rmtree(reward_root, ignore_errors=True)
        if owns:
            ray.shutdown()
    out = {}
    for name in plans:
        med = statistics.median(secs[name])
        out[name] = {"seconds": med, "spread": statistics.median(abs(x - med) for x in secs[name]),
                     "samples": per_round[name], "ops": {op: statistics.median(v) for op, v in ops[name].items()}}
    return out, speed


def pick_vs_fastest(picked: dict, fastest: dict) -> dict:
    """How far the pick is from the fastest plan, and whether that is more than noise: the ratio of
    medians, the median of the per-round ratios (round k of both ran minutes apart at most), and
    the gap in units of the two plans' summed spreads."""
    a, b = picked["iteration"]["measured"], fastest["iteration"]["measured"]
    paired = [x / y for x, y in zip(picked["samples"], fastest["samples"], strict=False) if y > 0]
    noise = picked["spread"] + fastest["spread"]
    return {"pick_over_fastest": a / b, "paired_ratio": statistics.median(paired) if paired else a / b,
            "gap_in_spreads": (a - b) / noise if noise > 0 else float("inf")}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.calibration.profile import resolve_profile
    from hybridflow.tools.reports.comparison import compare, predict_plan

    ap = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu-2core", help="profile file or shipped name (default cpu-2core)")
    ap.add_argument("--iterations", type=int, default=4, help="iterations per plan and round (the first is left out)")
    ap.add_argument("--rounds", type=int, default=3, help="times every plan runs, in turn (default 3)")
    ap.add_argument("--only", type=int, help="run only the first N plans (a quick look)")
    ap.add_argument("--no-speed-check", action="store_true", help="skip re-timing the profile's reference jobs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.iterations < 1 or args.rounds < 1:
        from hybridflow.simulator.errors import HflowError

        raise HflowError(f"--iterations {args.iterations} --rounds {args.rounds}: give at least 1 of each "
                         "(the first iteration of every run is start-up and is left out when there are more)")

    cal = calibrate_file(args.profile)
    cluster = cal.cluster(nodes=1, devices_per_node=2)
    cm = cal.cost_model(cluster)
    plans = candidate_plans(cluster.model_dump())
    pick = planner_pick(cluster, cm)
    pick_name = next((n for n, p in plans.items() if same_layout(p, pick)), None)
    if pick_name is None:
        pick_name = "planner's pick"
        plans[pick_name] = pick
    if args.only:
        plans = dict(list(plans.items())[:args.only])
    console = Console(file=sys.stderr)
    speed_profile = None if args.no_speed_check else resolve_profile(args.profile)
    measured, speed = measure_rounds(plans, args.iterations, args.rounds, on_run=lambda name, r: console.print(
        f"[dim]round {r + 1}/{args.rounds}: {name}, {args.iterations} iterations…[/]"), speed_profile=speed_profile)
    index = statistics.median(x for check in speed for x in check.ratios) if speed else 1.0
    rows = []
    for name, plan in plans.items():
        p_it, p_ops = predict_plan(plan, cm)
        m = measured[name]
        rows.append({"plan": name, "placement": plan.placement(), "spread": m["spread"], "samples": m["samples"],
                     **compare(p_it, p_ops, m["seconds"], m["ops"]),
                     "at_speed": compare(p_it * index, {k: v * index for k, v in p_ops.items()}, m["seconds"], m["ops"])})
    fastest = min(rows, key=lambda r: r["iteration"]["measured"])
    picked = next((r for r in rows if r["plan"] == pick_name), None)
    pick_ok = picked is not None and picked["iteration"]["measured"] <= 1.05 * fastest["iteration"]["measured"]
    raw, adjusted = accuracy(rows), accuracy([r["at_speed"] for r in rows])
    summary = {**raw, "planner_pick": pick_name, "fastest_measured": fastest["plan"], "pick_within_5pct": pick_ok,
               **(pick_vs_fastest(picked, fastest) if picked is not None else {}),
               "speed_index": index if speed else None, "speed_by_round": [check.index for check in speed],
               "at_speed": adjusted if speed else None}
    if args.json:
        print(json.dumps({"profile": cal.profile, "plans": rows, "summary": summary}))
        return 0
    out = Console(file=sys.stdout, width=max(Console().width, 120))
    t = Table(title=f"simulator accuracy: PPO, tiny model, {WORKLOAD['prompts']} prompts, profile '{cal.profile}'")
    cols = ["plan", "predicted s", "measured s", "± spread", "error"] + (["× speed", "error at speed"] if speed else [])
    for col in cols:
        t.add_column(col, justify="left" if col == "plan" else "right")
    for r in rows:
        mark = " ★" if r["plan"] == pick_name else ""
        it, at = r["iteration"], r["at_speed"]["iteration"]
        t.add_row(r["plan"] + mark, f"{it['predicted']:.3f}", f"{it['measured']:.3f}", f"{r['spread']:.3f}",
                  f"{it['error']:+.1%}", *([f"{at['predicted']:.3f}", f"{at['error']:+.1%}"] if speed else []))
    out.print(t)
    ops = Table(title="per op kind: median |error| over the plans")
    for col in ["op", "median |error|"] + (["at speed"] if speed else []) + ["plans"]:
        ops.add_column(col, justify="left" if col == "op" else "right")
    for op, e in raw["op_errors"].items():
        ops.add_row(op, f"{e:.1%}", *([f"{adjusted['op_errors'][op]:.1%}"] if speed else []), str(raw["op_plans"][op]))
    out.print(ops)
    verdict = ("not run (--only)" if picked is None else "fastest measured or within 5 %" if pick_ok
               else "NOT within 5 % of the fastest measured")
    out.print(f"median iteration error {raw['median_iteration_error']:.1%} (target ≤ 10 %); worst op kind "
              f"{max(raw['op_errors'].values()):.1%} (target ≤ 25 %); planner's pick ★ {pick_name}: {verdict} "
              f"(fastest: {fastest['plan']})")
    if speed:
        out.print(f"machine speed: the profile's reference jobs ran {index:.2f}× their profiled time (per round: "
                  f"{', '.join(f'{x:.2f}' for x in summary['speed_by_round'])}); predictions × {index:.2f}: median "
                  f"iteration error {adjusted['median_iteration_error']:.1%}, worst op kind "
                  f"{max(adjusted['op_errors'].values()):.1%}")
    if picked is not None and picked is not fastest:
        out.print(f"pick / fastest: {summary['pick_over_fastest']:.3f} by medians, {summary['paired_ratio']:.3f} "
                  f"by the median of per-round ratios; the gap is {summary['gap_in_spreads']:.1f}× their spreads")
    return 0


def accuracy(rows: list[dict]) -> dict:
    """Median |error| of the iteration over the plans, and per op kind (driver-side ops of a few ms,
    noise only, left out)."""
    by_op: dict[str, list[float]] = {}
    for r in rows:
        for op, v in r["ops"].items():
            if v["error"] is not None and v["measured"] > 0.005:
                by_op.setdefault(op, []).append(abs(v["error"]))
    return {"median_iteration_error": statistics.median(abs(r["iteration"]["error"]) for r in rows),
            "op_errors": {op: statistics.median(e) for op, e in by_op.items()},
            "op_plans": {op: len(e) for op, e in by_op.items()}}


if __name__ == "__main__":
    run_main(main)
