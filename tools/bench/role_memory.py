"""Role memory benchmark: the peak memory of each role's worker processes on the long-tail batch against the
memory model's figure for the same plan on the CPU device (issue 34: "the knobs honoured").

The batch, model and plan are the long-tail benchmark's packed + balanced side (long_tail.py: the tiny model,
`--dp` gloo processes, the token-balanced rows, the packing budget micro_batch_size · (64 + max)). Each role
runs in processes of its own, as the roles' workers do:

- policy (a trained role: actor): the log-prob pass and two optimizer steps (the second holds Adam's states);
- reference (a forward-only role: ref): the log-prob pass, twice.

Measured per process: its resident set (RSS, the kernel's count) when the process group is up, the role's
modules are imported and the same work has run once on the rank's two shortest rows on an engine then dropped
— the process baseline: Python, torch, gloo, this package, and what the work touches once per process (kernels'
code pages, the math libraries' set-up; "cold" is the RSS before that warm-up) — and its peak RSS (getrusage
ru_maxrss) after the role's work. The increment (peak − baseline) is what the role's work holds; the memory
model prices exactly that (weights, gradients, Adam's states, activations, logits, FSDP's gather buffers:
memory.py state_bytes at the element size, memory.at_element_bytes, + the role's largest transient at it; its
per-device reservation, a CUDA context on GPUs, is this baseline here).

Two allocators: glibc's default keeps freed blocks of a size it has seen in the heap (its mmap threshold
rises to the largest block freed), so the RSS peak also counts freed activations not yet reused, which no
model of live tensors prices; `pinned` fixes the mmap threshold at 128 KiB (mallopt M_MMAP_THRESHOLD, in
the worker process), so every large tensor is returned to the kernel when freed and the RSS follows the
live tensors, as torch.cuda.max_memory_allocated does on a GPU. The goal is checked on the pinned run; the
default run shows the allocator's caching on top.

    python -m hybridflow.tools.bench.role_memory            # dp 2, 64 sequences, responses mean 128 max 1024
    python -m hybridflow.tools.bench.role_memory --json out.json --check

Goal: every role's increment within 20 % of the memory model's figure (pinned allocator).
"""

from __future__ import annotations

from hybridflow.simulator.io import write_json_atomic
from hybridflow.tools.bench.long_tail import add_batch_args, bench_workload, check_batch_args, packing_budget
from hybridflow.tools.cli_help import OneLineErrorParser
from hybridflow.tools.outputs import run_main

ROLES = {"policy": "actor", "reference": "ref"}  # the bench's role → the plan role the memory model prices
GOAL = 0.20  # |model / measured increment - 1|
MMAP_THRESHOLD = 128 << 10
MiB = float(1 << 20)


def model_figure(role: str, dp: int, n: int, mean: int, longest: int, micro: int, element_bytes: int) -> dict:
    """The memory model's bytes per device of `role` on this plan: its states and its largest transient."""
    from hybridflow.simulator.pricing.memory import (
        at_element_bytes,
        forward_transient,
        state_bytes,
        train_transient,
    )
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.simulator.vocabulary.parallel import ParallelConfig
    from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES, role_head

    plan_role, w, budget = ROLES[role], bench_workload(n, mean, longest, micro), packing_budget(micro, longest)
    model, par, head = model_preset("tiny"), ParallelConfig(dp=dp), role_head(ROLES[role])
    trained = plan_role in TRAINED_ROLES
    states = at_element_bytes(state_bytes(model, head, par, trained), element_bytes)
    transients = [forward_transient(model, head, par, w, budget, element_bytes)]
    if trained:
        transients.append(train_transient(model, head, par, w, micro_batch_tokens=budget, element_bytes=element_bytes))
    own = states + max(transients, key=lambda m: m.total)
    return {"bytes": own.total, "parts": own.model_dump()}


def _pin_mmap_threshold() -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(-3, MMAP_THRESHOLD) != 1:  # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _role_work(role, local, width, budget) -> None:
    """The role's work on `local` (its rows of the batch), on an engine of its own, dropped at the end."""
    import torch

    from hybridflow.runtime.engines.train.fsdp.engine import FsdpEngine, OptimConfig
    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.simulator.vocabulary.parallel import ParallelConfig
    from hybridflow.tools.bench.long_tail import _loss

    torch.manual_seed(0)
    parallel = ParallelConfig(dp=torch.distributed.get_world_size())
    engine = FsdpEngine(CausalLM(model_preset("tiny").decoder_config()), parallel, optim=OptimConfig(lr=1e-4),
                        micro_batch_tokens=budget)
    for _ in range(2):
        engine.compute_log_probs(local, score_width=width)
        if role == "policy":
            engine.train_step(local, _loss(width), token_weights="response_mask", score_width=width)


def _role_rank(rank, world, role, n, mean, longest, micro, seed, pinned):
    import gc
    import resource

    if pinned:
        _pin_mmap_threshold()
    import psutil

    from hybridflow.runtime.controller.batch import Batch
    from hybridflow.runtime.controller.protocols import get_protocol
    from hybridflow.runtime.rl.batches import dp_balanced_order
    from hybridflow.simulator.vocabulary.parallel import ParallelConfig
    from hybridflow.tools.bench.long_tail import _batch

    data, width = _batch(n, mean, longest, seed)
    order = dp_balanced_order(data["attention_mask"], world)
    local = get_protocol("DP_COMPUTE").split(Batch(data)[order], ParallelConfig(dp=world))[0][rank].tensors
    cold = psutil.Process().memory_info().rss
    # The warm-up: the same work on the rank's two shortest rows, on an engine then dropped, so that what the
    # work touches once per process (the kernels' code pages, the math libraries' set-up, thread arenas: a
    # CUDA context's lazily loaded modules and workspaces on a GPU) is in the baseline, not in the work.
    shortest = local["attention_mask"].sum(-1).argsort()[:2]
    _role_work(role, {k: v[shortest] for k, v in local.items()}, width, packing_budget(micro, longest))
    gc.collect()  # the dropped engine's reference cycles
    baseline = psutil.Process().memory_info().rss
    _role_work(role, local, width, packing_budget(micro, longest))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"cold": cold, "baseline": baseline, "peak": peak, "tokens": int(local["attention_mask"].sum())}


def run(dp: int, n: int, mean: int, longest: int, micro: int, seed: int, element_bytes: int = 4) -> dict:
    from hybridflow.runtime.engines.launch import run_local

    out = {"dp": dp, "sequences": n, "response_mean": mean, "response_max": longest, "micro_batch_size": micro,
           "budget": packing_budget(micro, longest), "element_bytes": element_bytes, "roles": {}}
    for role in ROLES:
        figure = model_figure(role, dp, n, mean, longest, micro, element_bytes)
        runs = {}
        for allocator in ("default", "pinned"):
            ranks = run_local(_role_rank, dp, role, n, mean, longest, micro, seed, allocator == "pinned",
                              timeout=600.0)
            runs[allocator] = [{**r, "increment": r["peak"] - r["baseline"],
                                "error": figure["bytes"] / (r["peak"] - r["baseline"]) - 1.0} for r in ranks]
        out["roles"][role] = {"plan_role": ROLES[role], "model": figure, "ranks": runs}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineErrorParser(prog="role_memory", description=__doc__.split("\n\n")[0])
    add_batch_args(ap)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when a role's increment is more than {GOAL * 100:.0f} %% "
                    "off the memory model's figure (pinned allocator)")
    a = ap.parse_args(argv)
    check_batch_args(a)
    out = run(a.dp, a.sequences, a.mean, a.max, a.micro_batch_size, a.seed)
    print(f"role memory: {a.sequences} sequences, responses mean {a.mean} max {a.max}, dp {a.dp}, packed "
          f"(budget {out['budget']:,} tokens), fp32 on CPU; MiB per process")
    ok = True
    for role, v in out["roles"].items():
        parts = ", ".join(f"{k} {b / MiB:.1f}" for k, b in v["model"]["parts"].items() if b > 0)
        print(f"  {role} ({v['plan_role']}): memory model {v['model']['bytes'] / MiB:.1f} ({parts})")
        for allocator, ranks in v["ranks"].items():
            for i, r in enumerate(ranks):
                print(f"    {allocator:<7} rank {i}: baseline {r['cold'] / MiB:6.1f} → {r['baseline'] / MiB:6.1f} warmed  "
                      f"peak {r['peak'] / MiB:6.1f}  "
                      f"work {r['increment'] / MiB:6.1f} ({r['tokens']:,} tokens)  model {r['error']:+.1%}")
        ok = ok and all(abs(r["error"]) <= GOAL for r in v["ranks"]["pinned"])
    print(f"  goal: every role's work within ±{GOAL:.0%} of the memory model (pinned allocator): "
          f"{'met' if ok else 'NOT met'}")
    if a.json:
        write_json_atomic(a.json, out)
    return 1 if a.check and not ok else 0


if __name__ == "__main__":
    run_main(main)
