"""Measure the real engines' ops on this machine's devices: the points of a profile.

A profile run starts one torch.distributed group of `devices` processes (gloo on CPU — each a
"virtual device" with one thread, as the Ray workers run — NCCL on GPUs) and runs a list of
measurement jobs in it. Every job runs the very engine code a plan runs: FsdpEngine.train_step
and compute_log_probs/compute_values, GenerationEngine.generate (prefill + decode with its KV
cache), the 3D-HybridEngine Resharder (after the training engine's FSDP gather, as the hybrid
engine runs it), and the collectives. Each is warmed up, then timed at least `repeats` times (ops
under ~0.1 s more often) between barriers (so a point's time is the slowest rank's), and recorded
as a simulator ProfilePoint (median seconds, spread, the number of timed runs).

Layouts use all the group's ranks (world = devices) or one rank (world 1): then every rank runs its
own copy of the job at the same time, as the devices of a busy plan do, and rank 0's time counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridflow.runtime.engines.launch import report_progress
from hybridflow.runtime.measure.hardware_probe import probe_points, probe_rank, spec_from_probe
from hybridflow.runtime.measure.process_group import local_device, run_group
from hybridflow.simulator.calibration.profile import COLLECTIVE_OPS, MEGATRON_OPS, ProfilePoint
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def _has_megatron(jobs: list[dict]) -> bool:
    return any(j["op"] in MEGATRON_OPS for j in jobs)


# ---- timing ----------------------------------------------------------------------------------------
_ALL_RANKS = [True]  # whether the running job spans the whole group (else: rank 0 alone, no barriers)
_LAST_REPEATS = [0]  # how many timed runs the last timed_repeats made (recorded with the point)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if _ALL_RANKS[0]:
        dist.barrier()


# Cheap ops get more repeats (up to MAX_REPEATS, until about TARGET_SECONDS of timed runs): a
# 20 ms op timed 3 times carries the machine's jitter almost unfiltered into the fit.
TARGET_SECONDS = 0.3
MAX_REPEATS = 9


def timed_repeats(fn: Callable[[], object], warmup: int, repeats: int) -> tuple[float, float]:
    """(median, std) seconds of `fn` over at least `repeats` runs after `warmup`, every rank between
    barriers; ops the warm-up found cheap repeat more (the ranks agree on how many)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    if warmup:
        per_run = torch.tensor([(time.perf_counter() - t0) / warmup], dtype=torch.float64)
        if _ALL_RANKS[0]:
            dist.all_reduce(per_run, op=dist.ReduceOp.MAX)
        repeats = max(repeats, min(MAX_REPEATS, int(TARGET_SECONDS / max(float(per_run), 1e-6))))
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    _LAST_REPEATS[0] = len(times)
    return statistics.median(times), statistics.pstdev(times) if len(times) > 1 else 0.0


# ---- the jobs ------------------------------------------------------------------------------------
def _build(spec: ModelSpec, head: str, seed: int = 0):
    from hybridflow.runtime.models.decoder import CausalLM, ScoreModel

    torch.manual_seed(seed)
    cfg = spec.decoder_config(max_position_embeddings=4096)
    return (ScoreModel if head == "scalar" else CausalLM)(cfg).to(local_device())


_ENGINES: dict[tuple, object] = {}  # (model, head, layout) -> training engine, for the jobs of one group


def _engine(spec: ModelSpec, head: str, par: ParallelConfig, micro: int | None):
    """The job's engine (the layout's backend: FSDP2 or megatron-core): built once per (model, head,
    layout) and reused by the later jobs (building and sharding a model costs about as much as timing
    it); its weights only ever move by steps."""
    key = (spec.model_dump_json(), head, par)
    eng = _ENGINES.get(key)
    if eng is None and par.backend == "megatron":
        eng = _ENGINES[key] = _megatron_engine(spec, head, par)
    elif eng is None:
        from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine

        eng = _ENGINES[key] = FsdpEngine(_build(spec, head), par if par.world_size > 1 else None)
    eng.micro_batch_size = micro
    return eng


def _megatron_engine(spec: ModelSpec, head: str, par: ParallelConfig):
    """A MegatronEngine over the whole group. megatron-core keeps one parallel state per process, so
    a job in another layout first drops the engines of the last one and that state."""
    from megatron.core import parallel_state as ps

    from hybridflow.runtime.engines.train.megatron.engine import MegatronEngine

    if not any(k[2] == par for k in _ENGINES):
        for k in [k for k in _ENGINES if k[2].backend == "megatron"]:
            del _ENGINES[k]
        ps.destroy_model_parallel()
    return MegatronEngine(_build(spec, head), par)


def _tokens(n: int, s: int, vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, s), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _loss(outputs, micro):
    if "values" in outputs:
        return outputs["values"].pow(2).mean()
    return -outputs["log_probs"][:, 1:].mean()


def _local_rows(batch: int, par: ParallelConfig, rank: int) -> slice:
    """This rank's rows of a `batch` split over the layout's dp ranks (tp ranks share theirs)."""
    _, dp, _ = par.rank_coords(rank)
    per = -(-batch // par.dp)
    return slice(dp * per, min(batch, (dp + 1) * per))


def measure_jobs(rank: int, world: int, jobs: list[dict], warmup: int, repeats: int,
                 progress_offset: int = 0) -> list[dict]:
    """Run every job (a dict: op, model, head, parallel, gen, batch, lengths…) in this group; rank 0
    returns the ProfilePoints as dicts. Jobs run in order on every rank (collectives stay matched)."""
    out = []
    _ENGINES.clear()
    for job in jobs:
        par = ParallelConfig(**job.get("parallel", {}))
        if par.world_size not in (1, world):
            raise HflowError(f"layout {par} needs {par.world_size} ranks; the profile group has {world}")
        # A one-device job runs on every rank at once, each on its own copy (no communication):
        # the runtime's devices share the host's cores, and a plan keeps them busy side by side.
        _ALL_RANKS[0] = par.world_size == world or job["op"] in COLLECTIVE_OPS
        _LAST_REPEATS[0] = repeats
        seconds, std, extra = _JOBS[job["op"]](rank, par, job, warmup, repeats)
        dist.barrier()
        if rank == 0:
            report_progress(progress_offset + len(out) + 1)
            out.append({**{k: v for k, v in job.items() if k != "_"}, "seconds": max(seconds, 1e-9), "std": std,
                        "repeats": _LAST_REPEATS[0], **extra})
    _ENGINES.clear()
    return out


def _job_train(rank, par, job, warmup, repeats):
    spec = ModelSpec.model_validate(job["model"])
    eng = _engine(spec, job.get("head", "lm"), par, job.get("micro_batch"))
    data = _tokens(job["batch"], job["prompt_len"] + job["response_len"], spec.vocab)
    rows = _local_rows(job["batch"], par, rank)
    local = {k: v[rows].to(local_device()) for k, v in data.items()}
    steps = job.get("steps", 1)
    chunks = [{k: v[i::steps] for k, v in local.items()} for i in range(steps)]

    def step():
        for c in chunks:
            eng.train_step(c, _loss)

    return (*timed_repeats(step, warmup, repeats), {})


def _job_forward(rank, par, job, warmup, repeats):
    spec = ModelSpec.model_validate(job["model"])
    head = job.get("head", "lm")
    eng = _engine(spec, head, par, job.get("micro_batch"))
    data = _tokens(job["batch"], job["prompt_len"] + job["response_len"], spec.vocab)
    local = {k: v[_local_rows(job["batch"], par, rank)].to(local_device()) for k, v in data.items()}
    fn = eng.compute_values if head == "scalar" else eng.compute_log_probs
    return (*timed_repeats(lambda: fn(local), warmup, repeats), {})


def _job_generate(rank, par, job, warmup, repeats):
    """Generation in layout `par` as the PolicyWorker runs it: the tensor-parallel model itself
    when dp = 1, else a plain local model per rank generating its dp share of the prompts. Each row's end is
    checked every step as a rollout checks its EOS (here: its length, so every row runs `response_len`): small
    tensor ops and a host sync per step that every rollout pays, a visible share of a small batch's step on a CPU."""
    from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams

    spec = ModelSpec.model_validate(job["model"])
    model = _engine(spec, "lm", par, None).model if par.dp == 1 else _build(spec, "lm")
    model.eval()
    data = _tokens(job["batch"], job["prompt_len"], spec.vocab)
    ids = data["input_ids"][_local_rows(job["batch"], par, rank)].to(local_device())
    params = SamplingParams(max_new_tokens=job["response_len"], temperature=1.0, eos_token_id=None)
    gen = GenerationEngine(model)

    lengths = torch.full((ids.shape[0],), job["response_len"], dtype=torch.long)

    def run():
        g = torch.Generator(device=local_device()).manual_seed(7)
        gen.generate(ids, torch.ones_like(ids), params, g, lengths)

    return (*timed_repeats(run, warmup, repeats), {})


def _job_reshard(rank, par, job, warmup, repeats):
    from hybridflow.runtime.engines.rollout.hybrid import HybridEngine
    from hybridflow.runtime.models.decoder import CausalLM

    spec = ModelSpec.model_validate(job["model"])
    eng = _engine(spec, "lm", par, None)
    # the actor's switch as the runtime makes it: dp gather, regroup, copy into the generation model
    hybrid = HybridEngine(eng, CausalLM(eng.model.config), ParallelConfig(**job["gen"]), mode=job["mode"])
    stats = {}

    def run():
        stats["bytes"] = hybrid.to_generation().bytes_received

    s, sd = timed_repeats(run, warmup, repeats)
    return s, sd, {"bytes": float(stats.get("bytes", 0))}


def _job_collective(rank, par, job, warmup, repeats):
    n, world = job["group_size"], dist.get_world_size()
    group = dist.new_group(list(range(n))) if n < world else None
    elems = max(1, int(job["size_bytes"]) // 4)
    if rank >= n:
        dist.barrier()  # the others' timing loop ends with a barrier per repeat: match their count
        for _ in range(2 * repeats - 1):
            dist.barrier()
        return 0.0, 0.0, {}
    dev = local_device()
    if job["op"] == "allreduce":
        t = torch.ones(elems, device=dev)

        def run():
            dist.all_reduce(t, group=group)
    else:
        out = torch.empty(elems - elems % n or n, device=dev)
        piece = torch.ones(out.numel() // n, device=dev)

        def run():
            dist.all_gather_into_tensor(out, piece, group=group)

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    vol = (2.0 if job["op"] == "allreduce" else 1.0) * (n - 1) / n * elems * 4
    return med, statistics.pstdev(times) if len(times) > 1 else 0.0, {"bytes": vol}


_JOBS = {"train": _job_train, "forward": _job_forward, "generate": _job_generate, "reshard": _job_reshard,
         "allreduce": _job_collective, "allgather": _job_collective,
         # the same steps and forwards, on the engine the layout's backend (megatron) names
         "megatron_train": _job_train, "megatron_forward": _job_forward}


def measure(jobs: list[dict], devices: int, warmup: int = 1, repeats: int = 3, timeout: float = 3600.0,
            on_progress: Callable[[int], None] | None = None, passes: int = 1) -> list[ProfilePoint]:
    """Run `jobs` on a fresh group of `devices` processes, `passes` times over (merged as
    profile_machine merges them; no hardware probe); the measured ProfilePoints."""
    runs = run_group(_measure_rank, devices, jobs, warmup, repeats, passes, timeout=timeout * passes,
                     on_progress=on_progress, megatron=_has_megatron(jobs))[0]
    return [ProfilePoint.model_validate(r) for r in merge_passes(runs)]


def _measure_rank(rank: int, world: int, jobs: list[dict], warmup: int, repeats: int, passes: int) -> list[list[dict]]:
    return [measure_jobs(rank, world, jobs, warmup, repeats, progress_offset=p * len(jobs)) for p in range(passes)]


def _profile_rank(rank: int, world: int, jobs: list[dict], warmup: int, repeats: int,
                  passes: int) -> list[tuple[list[dict], list[dict]]]:
    """Per pass: every rank's hardware-probe figures, and the jobs' rows (rank 0's)."""
    out = []
    for p in range(passes):
        raws = [None] * world
        raw = probe_rank(rank, world, max(repeats, 3))
        dist.all_gather_object(raws, raw)
        out.append((raws, measure_jobs(rank, world, jobs, warmup, repeats, progress_offset=p * len(jobs))))
    return out


def merge_passes(passes: list[list[dict]]) -> list[dict]:
    """One row per job from its rows of several passes over the grid: the median of the passes'
    seconds (each a median over its repeats); the spread counts both the repeats' and the passes'
    (std = sqrt(mean within-pass variance + variance between passes)); repeats add up."""
    if len(passes) == 1:
        return passes[0]
    merged = []
    for rows in zip(*passes, strict=True):
        secs = [r["seconds"] for r in rows]
        within = statistics.fmean(r["std"] ** 2 for r in rows)
        merged.append({**rows[0], "seconds": statistics.median(secs),
                       "std": (within + statistics.pvariance(secs)) ** 0.5, "repeats": sum(r["repeats"] for r in rows)})
    return merged


def profile_machine(jobs: list[dict], devices: int, warmup: int = 1, repeats: int = 3, timeout: float = 3600.0,
                    on_progress: Callable[[int], None] | None = None, passes: int = 1):
    """The hardware probe and then every job, in one process group, `passes` times over (a shared
    machine's speed drifts from minute to minute: several passes minutes apart, merged by median,
    record its usual speed rather than one moment's): (HardwareSpec, probe points + measured points)."""
    if passes < 1:
        raise HflowError(f"passes={passes}: give at least 1")
    runs = run_group(_profile_rank, devices, jobs, warmup, repeats, passes, timeout=timeout * passes,
                     on_progress=on_progress, megatron=_has_megatron(jobs))[0]
    # per pass, the slowest rank's probe figures (every rank computes at once); then the passes' median
    per_pass = [{k: max(r[k] for r in raws) if k.endswith("_s") else raws[0][k] for k in raws[0]} for raws, _ in runs]
    raw = {k: statistics.median(r[k] for r in per_pass) if k.endswith("_s") else per_pass[0][k] for k in per_pass[0]}
    rows = merge_passes([rows for _, rows in runs])
    points = probe_points(raw, devices) + [ProfilePoint.model_validate(r) for r in rows]
    return spec_from_probe(raw, devices), points
