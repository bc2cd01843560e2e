"""The parallel configurations a model may take on a given number of devices.

Training (pp, tp, dp) with pp·tp·dp = n: tp divides the node size (a tensor-parallel group is
consecutive devices and never leaves a node) and the model's heads and kv heads; pp divides the
layers and is at most `max_pp`. A MoE model on the Megatron backend also takes every expert-parallel
size ep dividing dp and its expert count (ep splits the experts over dp ranks; it is not a factor of
n). The actor's generation layout (pp_g, tp_g, dp_g) on the same n devices has tp_g | tp and
pp_g | pp — the 3D-HybridEngine regroups the training shards without a redundant copy only then
(paper §5) — and pp_g ≤ `max_gen_pp` (our runtime generates with pp_g = 1; the paper's simulator
also prices pipelined generation). Generation layouts have no ep. A trained role's MoE model on
Megatron keeps tp = 1 (simulator/vocabulary/execution.py: our engine does not set the sequence parallelism
megatron-core needs there). An FSDP layout also takes every Ulysses sequence-parallel size sp dividing dp
with sp·tp inside a node and dividing the heads (`sequence_sizes`; like ep, not a factor of n), for
sequences of SP_MIN_SEQ_LEN tokens or more.
"""

from __future__ import annotations

from functools import lru_cache

from hybridflow.simulator.vocabulary.execution import moe_tp_problem
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


@lru_cache(maxsize=65536)
def train_configs(model: ModelSpec, devices: int, devices_per_node: int, max_pp: int | None = None,
                  max_tp: int | None = None, backends: tuple[str, ...] = ("fsdp",),
                  trained: bool = False, sequence_parallel: bool = False) -> tuple[ParallelConfig, ...]:
    """Every (pp, tp, dp) layout, once per training engine in `backends` (and per ep: `expert_sizes`; per
    sp with `sequence_parallel`: `sequence_sizes`, at pp = 1, where the FSDP engine runs Ulysses); `trained`: only
    those the runtime trains (`moe_tp_problem`)."""
    out = []
    for tp in divisors(devices):
        if devices_per_node % tp or model.heads % tp or model.kv_heads % tp:
            continue
        if max_tp is not None and tp > max_tp:
            continue
        for pp in divisors(devices // tp):
            if model.layers % pp or (max_pp is not None and pp > max_pp):
                continue
            dp = devices // (pp * tp)
            for b in backends:
                out.extend(ParallelConfig(pp=pp, tp=tp, dp=dp, backend=b, ep=ep, sp=sp)
                           for ep in expert_sizes(model, dp, b)
                           for sp in (sequence_sizes(model, dp, tp, devices_per_node, b)
                                      if sequence_parallel and pp == 1 else (1,)))
    return tuple(c for c in out if not (trained and moe_tp_problem(model, c)))


# Sequences at least this long (prompt + response) are searched with sequence parallelism: there one
# sequence's activations, not the weights, decide what fits. Shorter ones keep the search's size.
SP_MIN_SEQ_LEN = 4096


def searches_sp(seq_len: int) -> bool:
    return seq_len >= SP_MIN_SEQ_LEN


def sequence_sizes(model: ModelSpec, dp: int, tp: int, devices_per_node: int, backend: str) -> list[int]:
    """The Ulysses sequence-parallel sizes a layout may take (FSDP only): divisors of dp whose sp·tp divides
    the heads (and divides or is a multiple of the kv heads) and stays inside a node, where the all-to-alls
    run on its fast links."""
    if backend != "fsdp":
        return [1]
    return [sp for sp in divisors(dp) if devices_per_node % (sp * tp) == 0 and model.heads % (sp * tp) == 0
            and (model.kv_heads % (sp * tp) == 0 or (sp * tp) % model.kv_heads == 0)]


def expert_sizes(model: ModelSpec, dp: int, backend: str) -> list[int]:
    """The expert-parallel sizes a layout may take: divisors of dp and of the expert count for a MoE model
    trained by Megatron; 1 otherwise (a dense model, or FSDP, which keeps every expert on each rank)."""
    if backend != "megatron" or model.experts is None:
        return [1]
    return [ep for ep in divisors(dp) if model.experts % ep == 0]


@lru_cache(maxsize=65536)
def generate_configs(train: ParallelConfig, max_gen_pp: int | None = None) -> tuple[ParallelConfig, ...]:
    """Generation layouts reachable from `train` by the 3D-HybridEngine (same devices)."""
    n = train.world_size
    return tuple(ParallelConfig(pp=pg, tp=tg, dp=n // (pg * tg))
                 for tg in divisors(train.tp) for pg in divisors(train.pp)
                 if max_gen_pp is None or pg <= max_gen_pp)


@lru_cache(maxsize=65536)
def standalone_generate_configs(model: ModelSpec, devices: int, devices_per_node: int,
                                max_pp: int | None = None) -> tuple[ParallelConfig, ...]:
    """Generation layouts on devices of its own (OpenRLHF-style): any valid (pp, tp, dp)."""
    return train_configs(model, devices, devices_per_node, max_pp)
