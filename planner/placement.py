"""Placements (which models share devices) and allocations (how many devices each set gets).

Placement: every partition of the algorithm's models into colocation sets — Bell(4) = 15 for
PPO, Bell(6) = 203 for Safe-RLHF (reward and cost critics).

Allocation rule. A set gets either whole nodes (k · devices_per_node, k ≥ 1) or, when it is
smaller than a node, a proper divisor of devices_per_node; sub-node sets share the nodes left
over by the whole-node sets, never straddle a node boundary, and every device of the cluster is
used. Why: a group that spans a node only in part would put some of its collectives on the
slow inter-node link and leave fragments no other set can use; divisors of the node size tile
a node exactly (8 = 4 + 2 + 1 + 1), keep tensor-parallel groups inside one node, and match
the power-of-two head and layer counts of real models. Using every device is Algorithm 1's
rule (allocations of the N devices); an idle device never shortens our cost model's ops by
being idle.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.plan import Device

Placement = tuple[tuple[str, ...], ...]


def set_partitions(items: Sequence[str]) -> list[Placement]:
    """All partitions of `items` into non-empty sets, in a fixed order (items keep their order
    inside a set; sets are ordered by their first item)."""
    items = list(items)
    if not items:
        return [()]
    first, rest = items[0], items[1:]
    out: list[Placement] = []
    for sub in set_partitions(rest):
        out.append(((first,),) + sub)  # `first` alone
        for i in range(len(sub)):  # `first` joins set i
            out.append(sub[:i] + ((first,) + sub[i],) + sub[i + 1:])
    return [_ordered(p, items) for p in out]


def _ordered(p: Placement, items: list[str]) -> Placement:
    pos = {x: i for i, x in enumerate(items)}
    return tuple(sorted((tuple(sorted(s, key=pos.__getitem__)) for s in p), key=lambda s: pos[s[0]]))


def size_options(cluster: ClusterSpec) -> list[int]:
    """Device counts a set may get: proper divisors of a node, then whole nodes, ascending."""
    d = cluster.devices_per_node
    sub = [x for x in range(1, d) if d % x == 0]
    return sub + [k * d for k in range(1, cluster.nodes + 1)]


@lru_cache(maxsize=4096)
def _pack(sizes: tuple[int, ...], nodes: int, per_node: int) -> tuple[tuple[int, int], ...] | None:
    """Place sub-node sets (sizes, each < per_node) onto `nodes` nodes with no set straddling a
    node, filling them exactly. Returns (node, first index) per size, or None. Exact search:
    there are at most a handful of sub-node sets."""
    if sum(sizes) != nodes * per_node:
        return None
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    free = [per_node] * nodes
    where: list[tuple[int, int] | None] = [None] * len(sizes)

    def place(k: int) -> bool:
        if k == len(order):
            return True
        i = order[k]
        tried = set()
        for n in range(nodes):
            if free[n] >= sizes[i] and free[n] not in tried:
                tried.add(free[n])  # nodes with the same free space are interchangeable
                where[i] = (n, per_node - free[n])
                free[n] -= sizes[i]
                if place(k + 1):
                    return True
                free[n] += sizes[i]
        return False

    return tuple(where) if place(0) else None  # type: ignore[arg-type]


def allocation_ok(counts: Sequence[int], cluster: ClusterSpec) -> bool:
    d = cluster.devices_per_node
    whole = sum(c for c in counts if c >= d)
    if any(c >= d and c % d for c in counts) or any(c < d and d % c for c in counts):
        return False
    left_nodes = cluster.nodes - whole // d
    sub = tuple(sorted((c for c in counts if c < d), reverse=True))
    if left_nodes < 0:
        return False
    if not sub:
        return left_nodes == 0
    return _pack(sub, left_nodes, d) is not None


def allocations(min_devices: Sequence[int], cluster: ClusterSpec) -> Iterator[tuple[int, ...]]:
    """Every allocation (device count per set, in set order) under the rule above with each set
    getting at least its minimum."""
    total = cluster.num_devices
    opts = size_options(cluster)
    k = len(min_devices)
    # Smallest legal size of each set, for the "the rest must still fit" check.
    floor = [next((o for o in opts if o >= m), None) for m in min_devices]
    if any(f is None for f in floor):
        return
    tail_min = [0] * (k + 1)
    for i in range(k - 1, -1, -1):
        tail_min[i] = tail_min[i + 1] + floor[i]

    counts: list[int] = []

    def rec(i: int, left: int) -> Iterator[tuple[int, ...]]:
        if i == k:
            if left == 0 and allocation_ok(counts, cluster):
                yield tuple(counts)
            return
        for o in opts:
            if o < min_devices[i]:
                continue
            if o + tail_min[i + 1] > left:
                break
            counts.append(o)
            yield from rec(i + 1, left - o)
            counts.pop()

    if k:
        yield from rec(0, total)


def assign_devices(counts: Sequence[int], cluster: ClusterSpec) -> list[list[Device]]:
    """Concrete devices for an allocation: whole-node sets take consecutive nodes in set order,
    sub-node sets are packed into the nodes after them."""
    d = cluster.devices_per_node
    if not allocation_ok(counts, cluster):
        raise HflowError(f"allocation {list(counts)} does not tile a {cluster.nodes}x{d} cluster; "
                         f"give each set whole nodes or a divisor of {d} and use every device")
    out: list[list[Device]] = [[] for _ in counts]
    node = 0
    for i, c in enumerate(counts):
        if c >= d:
            out[i] = [Device(node=n, index=j) for n in range(node, node + c // d) for j in range(d)]
            node += c // d
    sub_idx = [i for i, c in enumerate(counts) if c < d]
    if sub_idx:
        sizes = tuple(counts[i] for i in sub_idx)
        where = _pack(sizes, cluster.nodes - node, d)
        assert where is not None
        for i, (n, first) in zip(sub_idx, where, strict=False):
            out[i] = [Device(node=node + n, index=first + j) for j in range(counts[i])]
    return out
