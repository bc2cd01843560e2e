"""Transfer protocols: how one driver call becomes one call per rank, and back (paper §4.2).

A worker method marked `@register("DP_COMPUTE")` is called once by the driver
(`group["actor"].compute_logprob(batch)`); the protocol's `split` turns each argument into one
value per rank, every rank runs the method, and `gather` turns the outputs of the ranks that
matter (`collect_ranks`) into one result. Built in:

| name          | each rank gets                         | the driver gets back                       |
|---------------|----------------------------------------|--------------------------------------------|
| `ONE_TO_ALL`  | every argument as it is                | the list of all ranks' outputs             |
| `ALL_TO_ALL`  | element `rank` of each list argument, or its share of a Batch/tensor (padded) | the list, or the batches concatenated (padding removed) |
| `RANK_ZERO`   | every argument as it is (all ranks run)| rank 0's output                            |
| `DP_COMPUTE` (alias `3D_PROTO`) | the dp shard of each Batch/tensor/list, the same on every tp/pp rank of the dp group (under sequence parallelism, sp > 1: one shard per dp/sp group, the same on its sp ranks); other arguments as they are | the outputs of tp = 0 of the last pp stage (and of each sp group's first rank), concatenated in dp order, padding removed (other outputs, e.g. metric dicts: their list in dp order) |

A batch whose size the dp size does not divide is padded with copies of its first samples and
the padding is removed from the gathered result. Add a protocol with `register_protocol(Protocol(
name, split, gather, collect_ranks))`; split and gather are plain functions of values, so the
same code runs in the driver and, when the input is another call's future, inside the workers.
Nothing here imports Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

# split(value, parallel) -> (one value per rank, info); gather(outputs of collect ranks, parallel, info) -> value
SplitFn = Callable[[Any, ParallelConfig], tuple[list[Any], dict]]
GatherFn = Callable[[list[Any], ParallelConfig, dict], Any]
CollectFn = Callable[[ParallelConfig], list[int]]


@dataclass(frozen=True)
class Protocol:
    name: str
    split: SplitFn
    gather: GatherFn
    collect_ranks: CollectFn = field(default=lambda p: list(range(p.world_size)))


PROTOCOLS: dict[str, Protocol] = {}


def register_protocol(protocol: Protocol, *aliases: str) -> Protocol:
    for name in (protocol.name, *aliases):
        PROTOCOLS[name] = protocol
    return protocol


def get_protocol(name: str | Protocol) -> Protocol:
    if isinstance(name, Protocol):
        return name
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise HflowError(f"unknown transfer protocol '{name}'; known: {', '.join(sorted(PROTOCOLS))} "
                         "(or add one with register_protocol)") from None


def register(protocol: str | Protocol = "ONE_TO_ALL", blocking: bool = True):
    """Mark a worker method as callable from the driver through `protocol`.

    `blocking=False`: the driver's call returns a future (`.get()` waits); every method also has
    `group[role].method.async_(...)`, which always returns one."""
    get_protocol(protocol)  # fail at class definition on a typo

    def mark(fn):
        fn._hflow_protocol = protocol.name if isinstance(protocol, Protocol) else protocol
        fn._hflow_blocking = blocking
        return fn

    return mark


def method_protocol(fn) -> tuple[str, bool]:
    """(protocol name, blocking) of a worker method; unmarked methods are ONE_TO_ALL, blocking."""
    return getattr(fn, "_hflow_protocol", "ONE_TO_ALL"), getattr(fn, "_hflow_blocking", True)


# ---- helpers: splitting and joining a value along its first dimension ----------------------------
def _splittable(v: Any) -> bool:
    return isinstance(v, (Batch, torch.Tensor, list))


def _length(v: Any) -> int:
    return len(v) if not isinstance(v, torch.Tensor) else v.shape[0]


def shard(value: Any, parts: int) -> tuple[list[Any], int]:
    """Pad `value` (Batch, tensor or list) to a multiple of `parts` and cut it into `parts` pieces."""
    n = _length(value)
    if n == 0:
        raise HflowError(f"cannot split an empty batch over {parts} ranks; give at least one sample")
    pad = -n % parts
    if isinstance(value, Batch):
        padded, pad = value.pad_to_multiple(parts)
        return padded.chunk(parts), pad
    idx = torch.arange(n + pad) % n
    if isinstance(value, torch.Tensor):
        return list(value[idx].chunk(parts)), pad
    padded = [value[i] for i in idx.tolist()]
    size = len(padded) // parts
    return [padded[i * size:(i + 1) * size] for i in range(parts)], pad


def join(parts: list[Any], pad: int = 0) -> Any:
    """Concatenate pieces made by `shard` (or the outputs computed from them) and drop `pad`.
    Outputs that do not concatenate (dicts, numbers) come back as a list, one per piece."""
    if all(p is None for p in parts):
        return None
    first = parts[0]
    if isinstance(first, Batch):
        whole = Batch.concat(parts)
        return whole.unpad(pad)
    if isinstance(first, torch.Tensor):
        whole = torch.cat(parts, dim=0)
    elif isinstance(first, list):
        whole = [x for p in parts for x in p]
    else:  # e.g. a metrics dict from a training step: one per shard, for the caller to reduce
        return list(parts)
    return whole[: _length(whole) - pad] if pad else whole


# ---- balancing: equal shares of rows holding about equal tokens ------------------------------------
def balanced_partition(weights: list[int], parts: int, max_swaps: int = 1000) -> list[list[int]]:
    """`weights` (a row's tokens, say) cut into `parts` parts of equal count (parts must divide them) with about
    equal sums: largest first, each to the lightest part that has room (ties: the lower part), then pairwise
    swaps between the heaviest and the lightest part while a swap narrows their gap (verl's sequence-length
    balancing does this with Karmarkar-Karp). Deterministic; each part's indices in ascending order."""
    n = len(weights)
    if parts < 1 or n % parts:
        raise HflowError(f"cannot cut {n} rows into {parts} equal parts; pad the batch to a multiple of {parts}")
    size = n // parts
    members: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        p = min((p for p in range(parts) if len(members[p]) < size), key=lambda p: (loads[p], p))
        members[p].append(i)
        loads[p] += weights[i]
    for _ in range(max_swaps):
        heavy = max(range(parts), key=lambda p: (loads[p], -p))
        light = min(range(parts), key=lambda p: (loads[p], p))
        gap = loads[heavy] - loads[light]
        best = None  # the swap leaving the smallest gap between the two, if smaller than now
        for a in members[heavy]:
            for b in members[light]:
                moved = weights[a] - weights[b]
                if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                    best = (abs(gap - 2 * moved), a, b, moved)
        if best is None or best[0] >= gap:
            break
        _, a, b, moved = best
        members[heavy][members[heavy].index(a)] = b
        members[light][members[light].index(b)] = a
        loads[heavy] -= moved
        loads[light] += moved
    return [sorted(m) for m in members]


def load_spread(weights: list[int], partition: list[list[int]]) -> float:
    """(most − least loaded part) / most loaded part: 0 for a perfect balance."""
    loads = [sum(weights[i] for i in part) for part in partition]
    return (max(loads) - min(loads)) / max(max(loads), 1)


# ---- the built-in protocols ------------------------------------------------------------------------
def _one_to_all_split(value, parallel):
    return [value] * parallel.world_size, {}


def _all_to_all_split(value, parallel):
    n = parallel.world_size
    if isinstance(value, (Batch, torch.Tensor)):
        parts, pad = shard(value, n)
        return parts, {"pad": pad, "joined": True}
    if isinstance(value, list):
        if len(value) != n:
            raise HflowError(f"ALL_TO_ALL needs one list item per rank: got {len(value)} for {n} ranks")
        return list(value), {}
    return [value] * n, {}


def _all_to_all_gather(outputs, parallel, info):
    return join(outputs, info["pad"]) if info.get("joined") else list(outputs)


def _dp_split(value, parallel):
    """One shard per dp/sp group: the sp ranks of a sequence-parallel group split the same rows' sequences."""
    if not _splittable(value):
        return [value] * parallel.world_size, {}
    shards, pad = shard(value, parallel.dp // parallel.sp)
    return [shards[parallel.rank_coords(r)[1] // parallel.sp] for r in range(parallel.world_size)], {"pad": pad}


def _dp_collect(parallel):
    """tp = 0 of the last pipeline stage, one rank per dp index (per sp group: its first), in dp order."""
    last = parallel.pp - 1
    return [last * parallel.dp * parallel.tp + d * parallel.tp for d in range(0, parallel.dp, parallel.sp)]


register_protocol(Protocol("ONE_TO_ALL", _one_to_all_split, lambda outs, p, info: list(outs)))
register_protocol(Protocol("RANK_ZERO", _one_to_all_split, lambda outs, p, info: outs[0], lambda p: [0]))
register_protocol(Protocol("ALL_TO_ALL", _all_to_all_split, _all_to_all_gather))
register_protocol(Protocol("DP_COMPUTE", _dp_split, lambda outs, p, info: join(outs, info.get("pad", 0)),
                           _dp_collect), "3D_PROTO")


# ---- applying a protocol to a whole call ----------------------------------------------------------
def merge_info(infos: list[dict]) -> dict:
    """The call's info from its arguments' infos: every split argument must agree on the padding."""
    out: dict = {}
    for info in infos:
        for k, v in info.items():
            if k in out and out[k] != v:
                raise HflowError(f"arguments of one call split differently ({k}={out[k]} vs {v}); "
                                 "give every batch argument the same number of samples")
            out[k] = v
    return out


def split_call(protocol: Protocol, parallel: ParallelConfig, args: tuple, kwargs: dict, split_value=None):
    """Per-rank (args, kwargs) and the call's info. `split_value(value)` -> (per-rank values, info)
    replaces `protocol.split` (the worker group uses it to defer futures to the workers)."""
    split_value = split_value or (lambda v: protocol.split(v, parallel))
    n = parallel.world_size
    split_args, infos = [], []
    for a in args:
        parts, info = split_value(a)
        split_args.append(parts)
        infos.append(info)
    split_kwargs = {}
    for k, v in kwargs.items():
        parts, info = split_value(v)
        split_kwargs[k] = parts
        infos.append(info)
    per_rank = [(tuple(p[r] for p in split_args), {k: p[r] for k, p in split_kwargs.items()}) for r in range(n)]
    return per_rank, merge_info(infos)
