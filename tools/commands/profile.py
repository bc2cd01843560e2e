"""`hflow-plan profile --out profiles/NAME.json`: measure the real engines' ops on this machine.

Runs the hardware probe and then a bounded grid — training steps, forward log-probs / values,
generation (prefill only and prefill + decode, several batches and lengths), the 3D-HybridEngine
reshard and all-reduce / all-gather at several sizes — over a few tiny Llama shapes and every
layout of 1 or all devices (tp, dp), with warm-up and repeats, on one process group of local
devices (GPUs when there are, else one gloo process per core). Writes a versioned Profile
(simulator/calibration/profile.py, documented in profiles/README.md) atomically, then fits the cost model to
it and prints the fit's error per op kind. Before writing, on a local Ray cluster, it measures the
single controller's dispatch gap between dependent calls (runtime/measure/dispatch_probe.py). `--quick`
is a seconds-long grid for tests (no Ray). `--passes N` measures the grid N times over in the same
processes and keeps each point's median (a shared machine's speed drifts between stretches of
minutes). `--check PROFILE` re-times a profile's own one-device points and prints now / then
(runtime/measure/profile_check.py): whether the machine still runs at the profile's speed. `--megatron`
adds the megatron-core engine's points (megatron_train / megatron_forward at dp, tp and pp over all
devices; minutes on 2 cores, so behind the flag), `--add-megatron PROFILE` measures only those into an
existing profile of this machine. A full profile also times the built-in tasks' rule-based rewards on
the controller (runtime/measure/reward_probe.py, the `reward` op's price) and its quick reference points on one
device alone against all busy (runtime/measure/alone_probe.py); `--add-reward PROFILE` measures
only those into an existing profile of this machine. `--add-alone PROFILE` re-times its quick reference
points on one device with the others idle and on all at once (runtime/measure/alone_probe.py): the
`alone_speedup` the schedule prices for a device whose neighbours idle.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridflow.simulator.calibration.profile import COLLECTIVE_OPS
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset
from hybridflow.simulator.vocabulary.plan import IN_PLACE_RESHARDS
from hybridflow.tools.cli_help import examples
from hybridflow.tools.flags import positive_int
from hybridflow.tools.reports.fit import print_fit

# Tiny Llama shapes (vocab 64: the character tokenizer's); their widths span the thin-shard fall-off. Heads of 32
# dimensions, as the tiny model's: the native engine's C decode attention runs whole pages of 32 (a model with
# 16-dimensional heads decodes through torch ops instead, a slower step than any real model's, which the fit
# would spread over every model's decode terms).
GRID_MODELS = {
    "p64": ModelSpec(name="p64", layers=2, hidden=64, heads=2, kv_heads=2, ffn=256, vocab=64),
    "tiny": model_preset("tiny"),
    "p256": ModelSpec(name="p256", layers=4, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=64),
}
COLLECTIVE_SIZES = (2**12, 2**16, 2**20, 2**24)


def layouts(devices: int, model: ModelSpec) -> list[dict]:
    """1 device, and all devices as tp (when it divides the heads) or dp."""
    out = [{}]
    if devices > 1:
        if model.heads % devices == 0 and model.kv_heads % devices == 0 and model.ffn % devices == 0:
            out.append({"tp": devices})
        out.append({"dp": devices})
    return out


def grid(devices: int, quick: bool = False) -> list[dict]:
    """The jobs a profile measures (dicts of ProfilePoint fields without the timings)."""
    models = [GRID_MODELS["p64"]] if quick else list(GRID_MODELS.values())
    # Shapes: small and large batches, and an RL-sized one (a batch of short rollouts in micro-batches
    # and two optimizer steps: where fixed per-pass costs weigh most on small models).
    fwd = [(8, 32, 8)] if quick else [(8, 32, 8), (16, 24, 8), (32, 64, 16)]  # (batch, seq, micro)
    trn = [(8, 32, 8, 1)] if quick else [(8, 32, 8, 1), (16, 24, 8, 2), (32, 64, 16, 2)]  # (+ optimizer steps)
    gen = ([(2, 8, 1), (2, 8, 4)] if quick  # (batch, prompt, new)
           else [(4, 16, 1), (4, 16, 16), (16, 12, 8), (32, 16, 32),
                 # long prompts' prefill (its attention), a decode over a long context (the KV reads per step)
                 # and a long decode of two rows (the per-step cost): a long tail's continued and last sequences
                 (8, 384, 1), (4, 384, 64), (2, 16, 128)])
    jobs: list[dict] = []
    for m in models:
        md = m.model_dump()
        for par in layouts(devices, m):
            if quick and par.get("dp"):
                continue
            for b, s, mb in fwd:
                half = s // 2
                jobs.append(dict(op="forward", model=md, parallel=par, batch=b, micro_batch=mb, prompt_len=half,
                                 response_len=s - half))
                if not quick and b > 8:
                    jobs.append(dict(op="forward", model=md, head="scalar", parallel=par, batch=b, micro_batch=mb,
                                     prompt_len=half, response_len=s - half))
            for b, s, mb, steps in trn:
                half = s // 2
                jobs.append(dict(op="train", model=md, parallel=par, batch=b, micro_batch=mb, steps=steps,
                                 prompt_len=half, response_len=s - half))
                if not quick and b > 8:
                    jobs.append(dict(op="train", model=md, head="scalar", parallel=par, batch=b, micro_batch=mb,
                                     steps=steps, prompt_len=half, response_len=s - half))
            for b, p, r in gen:
                if par.get("tp") and r > 8:
                    r = 8  # tensor-parallel decode is slow on gloo: a shorter run tells as much
                jobs.append(dict(op="generate", model=md, parallel=par, batch=b, prompt_len=p, response_len=r))
        if devices > 1 and layouts(devices, m)[1].get("tp"):
            for mode in (["hybridflow"] if quick else IN_PLACE_RESHARDS):
                jobs.append(dict(op="reshard", model=md, parallel={"tp": devices}, gen={"tp": 1, "dp": devices},
                                 mode=mode))
        if devices > 1 and not quick:  # FSDP-sharded training weights: the dp gather before the switch
            for mode in ("hybridflow", "ds-chat"):
                jobs.append(dict(op="reshard", model=md, parallel={"dp": devices}, gen={"tp": 1, "dp": devices},
                                 mode=mode))
    if devices > 1:
        for size in (COLLECTIVE_SIZES[1:3] if quick else COLLECTIVE_SIZES):
            for op in COLLECTIVE_OPS:
                jobs.append(dict(op=op, size_bytes=float(size), group_size=devices))
    return jobs


def megatron_layouts(devices: int, model: ModelSpec) -> list[dict]:
    """The megatron-core engine's layouts: all devices as dp (tp = pp = 1), as tp, as pp. One
    process group serves them all (megatron's parallel state is rebuilt between layouts); a
    one-device layout would need a group of its own, and each rank pays seconds importing megatron."""
    out = [{"dp": devices, "backend": "megatron"}]
    if devices > 1:
        if model.heads % devices == 0 and model.kv_heads % devices == 0 and model.ffn % devices == 0:
            out.append({"tp": devices, "backend": "megatron"})
        if model.layers % devices == 0:
            out.append({"pp": devices, "backend": "megatron"})
    return out


def megatron_grid(devices: int, quick: bool = False) -> list[dict]:
    """The megatron-core engine's points (megatron_train / megatron_forward) at the shapes the FSDP
    points use, grouped by layout (each layout's engines are built once; a model joins the layouts
    it fits)."""
    # quick: the tiny model, whose 4 heads split over 4 ranks (p64's 2 do not) so tp is measured there too
    models = [GRID_MODELS["tiny"]] if quick else [GRID_MODELS["p64"], GRID_MODELS["tiny"]]
    shapes = [(8, 32, 8, 1)] if quick else [(8, 32, 8, 1), (16, 24, 8, 2), (32, 64, 16, 2)]
    fits = [(m, megatron_layouts(devices, m)) for m in models]
    order = [par for _, pars in fits for par in pars]
    jobs: list[dict] = []
    for par in (p for i, p in enumerate(order) if p not in order[:i]):
        for m in (m for m, pars in fits if par in pars):
            for b, s, mb, steps in shapes:
                half = s // 2
                shape = dict(model=m.model_dump(), parallel=par, batch=b, micro_batch=mb, prompt_len=half,
                             response_len=s - half)
                jobs.append(dict(op="megatron_forward", **shape))
                jobs.append(dict(op="megatron_train", steps=steps, **shape))
    return jobs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile", help="measure the engines' op costs on this machine into a profile (JSON)",
        description="Measure training steps, forward passes, generation, resharding and collectives of the real "
                    "engines on this machine's devices (GPUs, else one gloo process per core) over a bounded "
                    "grid of tiny models and layouts; write a profile that `simulate/search --profile` and "
                    "`replay` use. The default grid takes a few minutes on 2 cores.",
        epilog=examples("hflow-plan profile --out profiles/my-box.json",
                        "hflow-plan profile --passes 3 --megatron --out profiles/my-box.json",
                        "hflow-plan profile --check cpu-2core"))
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", metavar="FILE.json", help="where to write the profile (atomically)")
    what.add_argument("--add-megatron", metavar="PROFILE.json",
                      help="measure only the Megatron engine's points on this machine and add them to this profile "
                           "of it (replacing the Megatron points it had; the rest kept as measured), refit, rewrite")
    what.add_argument("--add-reward", metavar="PROFILE.json",
                      help="time only the built-in tasks' rule-based rewards on this machine's controller and add "
                           "them to this profile of it (replacing the reward points it had), refit, rewrite")
    what.add_argument("--add-alone", metavar="PROFILE.json",
                      help="re-time this profile's quick reference points on one device with the others idle and "
                           "on all devices at once (the alone_speedup), add them (replacing the alone points it "
                           "had), refit, rewrite")
    what.add_argument("--check", metavar="PROFILE",
                      help="re-time a profile's own one-device points of the tiny model on this machine and print "
                           "seconds now / then (is it still this machine's speed?); writes nothing")
    p.add_argument("--quick", action="store_true", help="a seconds-long grid (one tiny model, no repeats)")
    p.add_argument("--megatron", action="store_true",
                   help="also measure the megatron-core engine (train steps and log-prob forwards at dp, tp and pp "
                        "over all devices: the megatron_* points that price roles with train.backend megatron); "
                        "needs hybridflow[megatron], and adds minutes on 2 cores")
    p.add_argument("--devices", type=positive_int, metavar="N",
                   help="device processes (default: GPUs, else the cores, >= 2)")
    p.add_argument("--repeats", type=positive_int, metavar="N", help="timed runs per point (default: 3; 1 with --quick)")
    p.add_argument("--warmup", type=int, metavar="N", help="untimed runs first (default: 1)")
    p.add_argument("--passes", type=positive_int, default=1, metavar="N",
                   help="measure the whole grid N times over, minutes apart, and keep each point's median: a "
                        "shared machine's speed drifts, and one pass records one moment's (the shipped profile "
                        "used 5)")
    p.add_argument("--name", help="the profile's name (default: the file's stem)")
    p.set_defaults(func=run)


def _require_torch(action: str) -> None:
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        raise HflowError(f"{action} runs the engines and needs torch: pip install 'hybridflow[runtime]'") from None


def _require_megatron() -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise HflowError("the Megatron points run megatron-core, which is not installed: pip install "
                         "'hybridflow[megatron]' (or profile without --megatron)")


def run(args) -> int:
    if args.check:
        return check(args.check)
    out = Path(args.out or args.add_megatron or args.add_reward or args.add_alone)
    if out.suffix.lower() != ".json":
        raise HflowError(f"{out}: a profile is JSON; give a file name ending in .json")
    if out.is_dir():
        raise HflowError(f"{out}: is a folder; give a file name")
    if args.add_megatron:
        return add_megatron(args, out)
    if args.add_reward:
        return add_reward(out)
    if args.add_alone:
        return add_alone(args, out)
    _require_torch("profiling")
    if args.megatron:
        _require_megatron()
    from rich.console import Console

    from hybridflow.runtime.measure.hardware_probe import default_devices, fingerprint
    from hybridflow.runtime.measure.profiling import profile_machine
    from hybridflow.simulator.calibration.fit import calibrate
    from hybridflow.simulator.calibration.profile import Profile

    devices = args.devices or default_devices()
    if devices < 1:
        raise HflowError(f"--devices {devices}: give at least 1 device")
    repeats = args.repeats or (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else 1
    if repeats < 1 or warmup < 0 or args.passes < 1:
        raise HflowError("--repeats and --passes must be >= 1 and --warmup >= 0")
    jobs = grid(devices, args.quick) + (megatron_grid(devices, args.quick) if args.megatron else [])
    hw, points = _with_progress(len(jobs) * args.passes,
                                lambda tick: profile_machine(jobs, devices, warmup, repeats, passes=args.passes,
                                                             on_progress=tick))
    if not args.quick and devices > 1:  # the controller's gap between calls: Ray, a few seconds
        from hybridflow.runtime.measure.dispatch_probe import measure_dispatch

        points.extend(measure_dispatch(devices))
    if not args.quick:
        from hybridflow.runtime.measure.reward_probe import measure_reward

        points.extend(measure_reward())
    profile = Profile(name=args.name or out.stem, fingerprint=fingerprint(devices), hardware=hw, points=points,
                      notes=f"hflow-plan profile{' --quick' if args.quick else ''}: {len(jobs)} jobs, "
                            f"warmup {warmup}, repeats {repeats}, passes {args.passes}")
    if not args.quick and devices > 1:  # a device alone against all busy, on the points just measured
        from hybridflow.runtime.measure.alone_probe import measure_alone
        from hybridflow.tools.reports.run import SPEED_CHECK_MAX_SECONDS

        alone = measure_alone(profile, passes=args.passes, max_seconds=SPEED_CHECK_MAX_SECONDS)
        profile = profile.model_copy(update={"points": points + alone})
    cal = calibrate(profile)  # before writing: a profile that cannot be fitted is not written
    profile.save(out)
    print_fit(cal, Console(file=sys.stdout), title=f"{out}: {len(points)} points on {devices} {hw.name} devices")
    return 0


def add_megatron(args, path: Path) -> int:
    """`--add-megatron PROFILE`: this machine's Megatron points measured into its existing profile."""
    from hybridflow.simulator.calibration.profile import MEGATRON_OPS

    def require():
        _require_torch("profiling")
        _require_megatron()

    def points(devices: int):
        from hybridflow.runtime.measure.profiling import measure

        jobs = megatron_grid(devices, args.quick)
        repeats, warmup = args.repeats or 3, args.warmup if args.warmup is not None else 1
        note = f"megatron points: {len(jobs)} jobs, warmup {warmup}, repeats {repeats}, passes {args.passes}"
        return _with_progress(len(jobs) * args.passes, lambda tick: measure(
            jobs, devices, warmup, repeats, passes=args.passes, on_progress=tick)), note

    return _add_points(path, MEGATRON_OPS, "megatron points:", "Megatron", require, points)


def add_reward(path: Path) -> int:
    """`--add-reward PROFILE`: this machine's rule-based reward points measured into its existing profile."""
    def points(devices: int):
        from hybridflow.runtime.measure.reward_probe import measure_reward

        got = measure_reward()
        return got, f"reward points: {len(got)} tasks, repeats {got[0].repeats}"

    return _add_points(path, ("reward",), "reward points:", "reward", lambda: _require_torch("profiling"), points)


def add_alone(args, path: Path) -> int:
    """`--add-alone PROFILE`: this machine's reference points timed alone and all busy, into its profile."""
    def points(devices: int):
        from hybridflow.runtime.measure.alone_probe import measure_alone
        from hybridflow.simulator.calibration.profile import Profile
        from hybridflow.tools.reports.run import SPEED_CHECK_MAX_SECONDS

        got = measure_alone(Profile.load(path), passes=args.passes, max_seconds=SPEED_CHECK_MAX_SECONDS)
        return got, f"alone points: {len(got) // 2} jobs, passes {args.passes}"

    return _add_points(path, ("alone",), "alone points:", "alone", lambda: _require_torch("profiling"), points)


def _add_points(path: Path, kinds: tuple[str, ...], note_prefix: str, what: str, require, measure_points) -> int:
    """Points of `kinds` measured on this machine (`measure_points(devices)` → (points, note), after
    `require()` checks what measuring needs) into its profile at `path`, replacing those it had and
    their note; refit, rewrite."""
    from rich.console import Console

    from hybridflow.simulator.calibration.fit import calibrate
    from hybridflow.simulator.calibration.profile import Profile

    profile = Profile.load(path)
    require()
    from hybridflow.runtime.measure.hardware_probe import fingerprint

    devices = profile.fingerprint.devices
    if not profile.fingerprint.same_machine(fingerprint(devices)):
        raise HflowError(f"{path} was measured on {profile.fingerprint.device_name} ({profile.fingerprint.cpu_count} "
                         "cores), not this machine: add points only to a profile of this machine (or measure a new "
                         "one with --out)")
    points, note = measure_points(devices)
    kept = [p for p in profile.points if p.op not in kinds]
    earlier = [n for n in profile.notes.split("; ") if n and not n.startswith(note_prefix)]
    profile = profile.model_copy(update={"points": kept + points, "notes": "; ".join([*earlier, note])})
    profile = Profile.model_validate(profile.model_dump())
    cal = calibrate(profile)
    profile.save(path)
    print_fit(cal, Console(file=sys.stdout), title=f"{path}: {len(points)} {what} points added")
    return 0


def _with_progress(total: int, work):
    """`work(tick)` under a progress bar on stderr (`tick(done)` moves it)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task("profile", total=total)
        return work(lambda done: bar.update(task, completed=done))


def check(name: str) -> int:
    """`--check PROFILE`: the profile's reference points re-timed now, per point and the median."""
    from rich.console import Console
    from rich.table import Table

    from hybridflow.simulator.calibration.profile import resolve_profile

    profile = resolve_profile(name)
    _require_torch("checking a profile")
    from hybridflow.runtime.measure.hardware_probe import fingerprint
    from hybridflow.runtime.measure.profile_check import check_speed

    here = fingerprint(profile.fingerprint.devices)
    if not profile.fingerprint.same_machine(here):
        raise HflowError(f"profile '{profile.name}' was measured on {profile.fingerprint.device_name} "
                         f"({profile.fingerprint.cpu_count} cores), this is {here.device_name} ({here.cpu_count} "
                         "cores); --check compares a machine with its own profile: measure one here with --out")
    result = check_speed(profile)
    t = Table(title=f"profile '{profile.name}' ({profile.fingerprint.created}) re-timed now")
    for col in ("op", "head", "batch", "tokens", "then ms", "now ms", "now / then"):
        t.add_column(col, justify="left" if col in ("op", "head") else "right")
    for job, then, now in zip(result.jobs, result.profiled, result.now, strict=True):
        t.add_row(job["op"], job["head"], str(job["batch"]), f"{job['prompt_len']}+{job['response_len']}",
                  f"{then * 1e3:.1f}", f"{now * 1e3:.1f}", f"{now / then:.2f}")
    console = Console(file=sys.stdout)
    console.print(t)
    console.print(f"median now / then: {result.index:.2f} over {len(result.now)} points (per point "
                  f"{min(result.ratios):.2f}–{max(result.ratios):.2f}); above ~1.1 or below ~0.9 the machine runs at "
                  "another speed than when profiled: predictions scale by about that much (re-profile, or use "
                  "`--passes` for a profile of its usual speed)")
    return 0
