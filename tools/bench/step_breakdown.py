"""Where one GRPO step's time goes: each phase in seconds and as a share of the step, the compute
phases' achieved FLOP/s and bytes/s beside this machine's measured roofline.

    python -m hybridflow.tools.bench.step_breakdown [--model tiny,qwen2-bpe] [--steps 4] [--prompts 16]
        [--samples 4] [--response-len 16] [--micro-batch 32] [--devices N] [--kl 0.04] [--seed 0] [--json]

Runs the Trainer on a local Ray cluster (plan: one group of `--devices` workers, data parallel, the
actor and, with `--kl` > 0, the reference colocated; GRPO, one epoch of one mini-batch, KL in the
loss), with the workers' phase clocks on (engines/phase_clock.py), and splits each step:

- the Timeline's measured ops (`reshard`, `generate`, `ref_logprob`/`actor_logprob`, `actor_update`,
  and the driver's `reward` and `advantage`), as the workers and the driver time them;
- inside them, the engines' phases: generation into `fuse_weights` (the fused decoder's weights, cache,
  masks and RoPE tables), `prefill`, `decode` (the model's steps) and `sample` (sampling and EOS
  bookkeeping); a log-prob pass's `infer` (forwards); the update's `forward` (with the loss),
  `backward` and `optimizer` (clipping, AdamW); what an op spends outside its phases is `other`
  (tensor copies, batch building, waiting for the slowest rank);
- the controller: the step's time outside every op — the driver's prompt batch, splitting and
  joining batches, Ray calls, serialisation and transfers — by the op it leads to ("→ generate"),
  and after the last op (the trainer's metrics).

Phase seconds are the mean over the ranks that ran them. FLOPs: 2·(matmul parameters) per token plus
attention over the context the phase's tokens read (the simulator's ModelSpec formulas), over the
tokens each pass computes (padding to a micro-batch's longest row included; `real` is the share
that is not padding); backward = 2 × forward. Bytes: decode reads the weights once per step and the
KV cache it attends to; AdamW reads and writes ~28 bytes per parameter (fp32 weight, gradient and
two moments); a reshard receives the bytes it reports and copies the weights (fp32
read and write) into the generation model. Per device, beside the probe's matmul FLOP/s
and memory bandwidth for this many device processes (runtime/measure/hardware_probe.py, cached).
The split shown is that of the median step (by its span) after the first (the first pays for
warm-up), so its rows add up to it; the spans of all the measured steps are printed beside it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time

from hybridflow.simulator.errors import HflowError
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

TASK = "sort"
SUBPHASES = {  # the engine phases inside each measured op, in order
    "generate": ("fuse_weights", "prefill", "decode", "sample"),
    "actor_logprob": ("infer",), "ref_logprob": ("infer",),
    "actor_update": ("forward", "backward", "optimizer"),
}
ORDER = ("reshard", "generate", "reward", "ref_logprob", "actor_logprob", "advantage", "actor_update")


# ---- measuring ----------------------------------------------------------------------------------
def _plan(args, folder: str | None, spec):
    from hybridflow.runtime.measure.hardware_probe import local_cluster
    from hybridflow.runtime.tasks.builtin import get_task
    from hybridflow.simulator import Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload

    n = args.devices
    group = DeviceGroup(name="all", devices=[Device(node=0, index=i) for i in range(n)])
    names = ("actor", "ref") if args.kl > 0 else ("actor",)
    roles = {r: RolePlan(model=spec, group="all", train=ParallelConfig(dp=n), path=folder) for r in names}
    workload = Workload(prompts=args.prompts, samples_per_prompt=args.samples, prompt_len=16,
                        response_len=args.response_len, micro_batch_size=args.micro_batch, ppo_epochs=1,
                        mini_batches=1)
    return Plan(algorithm="grpo", cluster=local_cluster(max(n, 2)), workload=workload, groups=[group], roles=roles,
                reward_function=get_task(TASK).reward_function, notes="step breakdown")


def measure_steps(args, folder: str | None, spec) -> list[dict]:
    """Run `args.steps` GRPO steps; per step: its span, its measured events, each role's phase clocks."""
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.runtime.rl.trainer import Trainer

    cfg = RunConfig(seed=args.seed, data={"task": TASK}, sampling={"temperature": 1.0},
                    optimizer={"actor": {"lr": args.lr, "grad_clip": 1.0}}, loss={"clip_ratio": 0.2},
                    kl={"coef": args.kl, "placement": "loss", "estimator": "k3"})
    trainer = Trainer(_plan(args, folder, spec), cfg)
    steps = []
    try:
        trainer.start()
        roles = list(trainer.plan.roles)
        for role in roles:
            trainer.groups[role].call(role, "time_phases", True)
        for _ in range(args.steps):
            start = time.time()
            metrics = trainer.step()
            end = time.time()
            phases = {role: trainer.groups[role].call(role, "take_phases") for role in roles}
            origin = trainer.df.origin
            events = [e.model_dump() for e in trainer.timeline.events if e.iteration == trainer.iteration]
            steps.append({"start": start - origin, "end": end - origin, "events": events, "phases": phases,
                          "tokens": metrics["tokens"], "reward": metrics["reward_mean"]})
    finally:
        trainer.shutdown()
    return steps


# ---- splitting a step ---------------------------------------------------------------------------
def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _minus(spans: list[tuple[float, float]], taken: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of `spans` outside `taken` (both unions: sorted, disjoint)."""
    out = []
    for s, e in spans:
        cur = s
        for ts, te in taken:
            if te <= cur or ts >= e:
                continue
            if ts > cur:
                out.append((cur, ts))
            cur = max(cur, te)
        if cur < e:
            out.append((cur, e))
    return out


def _mean_over_ranks(per_rank: list[dict], key: str) -> float:
    return statistics.fmean(r.get(key, 0.0) for r in per_rank) if per_rank else 0.0


def _work(spec, phase: str, per_rank: list[dict], reshard_bytes: float) -> tuple[float, float, str]:
    """(FLOPs, bytes) over all ranks for `phase`, and a few words on its work."""
    total = {k: sum(r.get(f"{phase}.{k}", 0.0) for r in per_rank) for k in ("tokens", "real_tokens", "context",
                                                                              "calls")}
    f0 = spec.forward_flops_per_token(0)
    per_context = spec.forward_flops_per_token(1) - f0
    if phase == "backward":
        fwd = _work(spec, "forward", per_rank, 0.0)[0]
        return 2 * fwd, 0.0, "2 × forward"
    if phase == "optimizer":
        return 0.0, 28.0 * spec.num_params(), f"{spec.num_params() / 1e6:.1f} M params"
    if phase == "reshard":  # what it received, and each rank's copy into its generation weights (read + write)
        copied = 8.0 * spec.num_params() * max(len(per_rank), 1)
        return 0.0, reshard_bytes + copied, f"{reshard_bytes / 2**20:.1f} MiB received, weights copied"
    if phase not in ("prefill", "decode", "infer", "forward") or not total["tokens"]:
        return 0.0, 0.0, ""
    flops = total["tokens"] * f0 + total["context"] * per_context
    nbytes = 0.0
    words = f"{total['tokens']:,.0f} tok"
    if phase == "decode":  # each step reads the weights once, and the keys and values it attends to
        nbytes = total["calls"] * spec.matmul_params() * 4 + total["context"] * spec.kv_bytes_per_token(4)
        words += f" in {total['calls'] / max(len(per_rank), 1):.0f} steps"
    if total["real_tokens"]:
        words += f", {total['real_tokens'] / total['tokens']:.0%} real"
    return flops, nbytes, words


def split_step(step: dict, spec, world: int) -> list[dict]:
    """Rows (phase, parent op, seconds, FLOPs, bytes, note) of one step; seconds sum to the step's span: each
    op's events are taken within the step, and time two ops share (the driver's work beside a call in flight)
    counts for the op first in ORDER only."""
    rows = []
    lo, hi = step["start"], step["end"]
    events = [{**e, "start": max(e["start"], lo), "end": min(e["end"], hi)} for e in step["events"]
              if min(e["end"], hi) > max(e["start"], lo)]
    by_op: dict[str, list[dict]] = {}
    for e in events:
        by_op.setdefault(e["op"], []).append(e)
    clocks = step["phases"]
    counted: list[tuple[float, float]] = []  # the step's time already given to an op
    for op in [*ORDER, *sorted(set(by_op) - set(ORDER))]:
        if op not in by_op:
            continue
        evs = by_op[op]
        own = _union([(e["start"], e["end"]) for e in evs])
        seconds = sum(e - s for s, e in _minus(own, counted))
        counted = _union(counted + own)
        role = evs[0]["role"]
        on_driver = evs[0]["group"] == "driver"
        per_rank = [] if on_driver else clocks.get(role, [])
        subs = SUBPHASES.get(op, ())
        inner = 0.0
        flops, nbytes, note = _work(spec, op, per_rank, sum(e.get("bytes", 0.0) for e in evs))
        rows.append({"phase": op, "parent": None, "seconds": seconds, "flops": flops, "bytes": nbytes, "note": note,
                     "ranks": 1 if on_driver else world, "driver": on_driver})
        for sub in subs:
            s = _mean_over_ranks(per_rank, sub)
            if s <= 0:
                continue
            inner += s
            flops, nbytes, note = _work(spec, sub, per_rank, 0.0)
            rows.append({"phase": sub, "parent": op, "seconds": s, "flops": flops, "bytes": nbytes, "note": note,
                         "ranks": world, "driver": False})
        if subs and inner > 0:
            rows.append({"phase": "other", "parent": op, "seconds": max(seconds - inner, 0.0), "flops": 0.0,
                         "bytes": 0.0, "note": "outside the engine's phases", "ranks": world, "driver": False})
    # the controller: the step's time outside every op (every op's time is `counted` now), by the op it leads to
    busy = counted
    cursor, gaps = step["start"], {}
    for (s, e), nxt in zip(busy, [min((ev for ev in events if ev["start"] >= s), key=lambda ev: ev["start"])["op"]
                                   for s, _ in busy], strict=True):
        gaps[f"→ {nxt}"] = gaps.get(f"→ {nxt}", 0.0) + max(s - cursor, 0.0)
        cursor = e
    gaps["after the last op"] = max(step["end"] - cursor, 0.0)
    rows.append({"phase": "controller", "parent": None, "seconds": sum(gaps.values()), "flops": 0.0, "bytes": 0.0,
                 "note": "driver glue, Ray calls, serialisation, transfers", "ranks": 1, "driver": True})
    for name, s in gaps.items():
        rows.append({"phase": name, "parent": "controller", "seconds": s, "flops": 0.0, "bytes": 0.0, "note": "",
                     "ranks": 1, "driver": True})
    return rows


def breakdown(steps: list[dict], spec, world: int, hardware) -> dict:
    """The split of the median step (by its span) of those after the first, with shares and roofline
    fractions: one real step, so its rows add up to it; every measured step's seconds beside it."""
    rest = steps[1:] or steps
    spans = [s["end"] - s["start"] for s in rest]
    median = rest[spans.index(statistics.median_low(spans))]
    step_seconds = median["end"] - median["start"]
    out = []
    for r in split_step(median, spec, world):
        per_device = r["seconds"] * r["ranks"]
        row = {"phase": r["phase"], "parent": r["parent"], "seconds": r["seconds"], "share": r["seconds"] / step_seconds,
               "note": r["note"], "flops_per_s": r["flops"] / per_device if r["flops"] and per_device else None,
               "bytes_per_s": r["bytes"] / per_device if r["bytes"] and per_device else None}
        row["peak_fraction"] = row["flops_per_s"] / hardware.peak_flops if row["flops_per_s"] else None
        row["bandwidth_fraction"] = row["bytes_per_s"] / hardware.hbm_bandwidth if row["bytes_per_s"] else None
        out.append(row)
    return {"step_seconds": step_seconds, "tokens_per_second": median["tokens"] / step_seconds, "rows": out,
            "steps_measured": len(rest), "step_spans": spans, "rewards": [s["reward"] for s in steps],
            "roofline": {"matmul_flops_per_device": hardware.peak_flops, "bytes_per_s_per_device": hardware.hbm_bandwidth}}


# ---- the report ---------------------------------------------------------------------------------
def _si(x: float | None, unit: str) -> str:
    if not x:
        return ""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x else ""


def print_breakdown(name: str, args, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    r = result["roofline"]
    t = Table(title=f"One GRPO step, {name}: {args.prompts} prompts × {args.samples} samples, ≤{args.response_len} new "
                    f"tokens, {args.devices} device(s), KL {args.kl:g} — {result['step_seconds']:.3f} s, "
                    f"{result['tokens_per_second']:,.0f} tok/s (the median of {result['steps_measured']} steps: "
                    f"{', '.join(f'{x:.3f}' for x in result['step_spans'])} s). "
                    f"Roofline per device: {_si(r['matmul_flops_per_device'], 'FLOP/s')}, "
                    f"{_si(r['bytes_per_s_per_device'], 'B/s')}", title_justify="left")
    for col in ("phase", "seconds", "share", "work", "FLOP/s/dev", "% peak", "B/s/dev", "% bw"):
        t.add_column(col, justify="left" if col in ("phase", "work") else "right")
    for row in result["rows"]:
        name = row["phase"] if row["parent"] is None else f"  {row['phase']}"
        t.add_row(name, f"{row['seconds']:.4f}", f"{row['share']:.1%}", row["note"], _si(row["flops_per_s"], "FLOP/s"),
                  _pct(row["peak_fraction"]), _si(row["bytes_per_s"], "B/s"), _pct(row["bandwidth_fraction"]))
    Console(width=max(Console().width, 140)).print(t)


def run(args) -> dict[str, dict]:
    import ray

    from hybridflow.runtime.measure.hardware_probe import probe_hardware
    from hybridflow.tools.bench.bench_models import bench_model

    # measured now, not the cached probe: a roofline read on a busier stretch would flatter every phase
    hardware = probe_hardware(args.devices, refresh=True)
    own_ray = not ray.is_initialized()
    if own_ray:  # one local Ray cluster for every model (a new one, never an outside `ray start` one)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.devices), include_dashboard=False,
                 logging_level=logging.WARNING)
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="hflow-breakdown-") as work:
            for name in args.model:
                folder, spec = bench_model(name, work, args.seed)
                results[name] = breakdown(measure_steps(args, folder, spec), spec, args.devices, hardware)
    finally:
        if own_ray:
            ray.shutdown()
    return results


def _models(text: str) -> list[str]:
    from hybridflow.tools.bench.bench_models import BENCH_MODELS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BENCH_MODELS]
    if bad or not names:
        raise HflowError(f"--model {text}: give one or more of {', '.join(BENCH_MODELS)}, comma-separated")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny,qwen2-bpe", help="models, comma-separated (default tiny,qwen2-bpe)")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per model (≥ 2: the first is left out; default 4)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    ap.add_argument("--response-len", type=int, default=16, help="max new tokens (default 16)")
    ap.add_argument("--micro-batch", type=int, default=32, help="sequences per forward/backward per worker (default 32)")
    ap.add_argument("--devices", type=int, default=os.cpu_count() or 1, help="Ray workers (default: cores)")
    ap.add_argument("--kl", type=float, default=0.04, help="KL coefficient (0: no reference model; default 0.04)")
    ap.add_argument("--lr", type=float, default=5e-4, help="learning rate (default 5e-4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    args.model = _models(args.model)
    if args.steps < 2:
        raise HflowError(f"--steps {args.steps}: give at least 2 (the first step is left out of the breakdown)")
    if min(args.prompts, args.response_len, args.micro_batch, args.devices) < 1 or args.samples < 2:
        raise HflowError("--prompts, --response-len, --micro-batch and --devices must be ≥ 1 and --samples ≥ 2 "
                         "(GRPO compares samples of a prompt)")
    if args.kl < 0:
        raise HflowError(f"--kl {args.kl}: give a coefficient ≥ 0 (0: no reference model)")
    if args.prompts * args.samples < args.devices:
        raise HflowError(f"--prompts × --samples = {args.prompts * args.samples} rows for {args.devices} devices: "
                         "give every device at least one row")
    logging.getLogger("ray").setLevel(logging.WARNING)
    results = run(args)
    if args.json:
        print(json.dumps({"args": vars(args), "models": results}))
    else:
        for name, result in results.items():
            print_breakdown(name, args, result)
    return 0


if __name__ == "__main__":
    run_main(main)
