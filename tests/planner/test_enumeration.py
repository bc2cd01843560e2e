"""Placements, allocations and parallel configs the planner enumerates."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.planner.configs import generate_configs, train_configs
from hybridflow.planner.placement import (
    allocation_ok,
    allocations,
    assign_devices,
    set_partitions,
    size_options,
)
from hybridflow.simulator import ClusterSpec, HflowError, hardware_preset, model_preset

A100 = hardware_preset("a100-80g")


def cluster(nodes, per=8):
    return ClusterSpec(hardware=A100, nodes=nodes, devices_per_node=per)


def test_bell_numbers():
    assert [len(set_partitions("abcdefg"[:k])) for k in range(1, 8)] == [1, 2, 5, 15, 52, 203, 877]


def test_partitions_are_partitions_and_distinct():
    parts = set_partitions(["actor", "critic", "ref", "reward", "cost"])
    canon = {frozenset(frozenset(s) for s in p) for p in parts}
    assert len(canon) == len(parts) == 52
    for p in parts:
        assert sorted(r for s in p for r in s) == sorted(["actor", "critic", "ref", "reward", "cost"])


def test_size_options_are_node_divisors_then_whole_nodes():
    assert size_options(cluster(3)) == [1, 2, 4, 8, 16, 24]
    assert size_options(cluster(2, per=6)) == [1, 2, 3, 6, 12]


def test_allocations_one_node():
    assert sorted(allocations([1, 1, 1], cluster(1))) == [(2, 2, 4), (2, 4, 2), (4, 2, 2)]
    assert list(allocations([1], cluster(1))) == [(8,)]
    assert list(allocations([9], cluster(1))) == []


def test_allocations_respect_minimums_and_use_every_device():
    allocs = list(allocations([16, 1, 1], cluster(4)))
    assert allocs and all(a[0] >= 16 and sum(a) == 32 for a in allocs)
    assert (16, 8, 8) in allocs and (24, 4, 4) in allocs and (16, 12, 4) not in allocs


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 4), per=st.sampled_from([2, 4, 6, 8]), k=st.integers(1, 4))
def test_every_allocation_tiles_the_cluster(nodes, per, k):
    c = cluster(nodes, per)
    allocs = list(allocations([1] * k, c))
    # brute force over all size tuples: the generator yields exactly the legal ones
    from itertools import product

    legal = [t for t in product(size_options(c), repeat=k) if sum(t) == c.num_devices and allocation_ok(t, c)]
    assert sorted(allocs) == sorted(legal)
    for a in allocs:
        groups = assign_devices(a, c)
        flat = [(d.node, d.index) for g in groups for d in g]
        assert len(flat) == len(set(flat)) == c.num_devices
        for g, n in zip(groups, a, strict=False):
            assert len(g) == n
            if n < per:  # a sub-node set stays in one node
                assert len({d.node for d in g}) == 1


def test_assign_devices_rejects_bad_allocation():
    with pytest.raises(HflowError, match="does not tile"):
        assign_devices((3, 5), cluster(1))


def test_train_configs_obey_the_rules():
    m = model_preset("llama2-70b")  # 80 layers, 64 heads, 8 kv heads
    cfgs = train_configs(m, 128, 8)
    assert cfgs and all(c.world_size == 128 for c in cfgs)
    for c in cfgs:
        assert 8 % c.tp == 0 and m.heads % c.tp == 0 and m.kv_heads % c.tp == 0 and m.layers % c.pp == 0
    assert {c.tp for c in cfgs} == {1, 2, 4, 8}
    assert {c.pp for c in cfgs} == {1, 2, 4, 8, 16}
    assert all(c.pp == 1 for c in train_configs(m, 128, 8, max_pp=1))


def test_generate_configs_divide_the_training_layout():
    from hybridflow.simulator import ParallelConfig

    t = ParallelConfig(pp=4, tp=4, dp=2)
    gens = generate_configs(t)
    assert len(gens) == 9  # 3 tp divisors × 3 pp divisors
    for g in gens:
        assert t.tp % g.tp == 0 and t.pp % g.pp == 0 and g.world_size == 32
    runnable = generate_configs(t, max_gen_pp=1)  # what `hflow-plan run` can execute
    assert [g.tp for g in runnable] == [1, 2, 4] and all(g.pp == 1 and g.dp == 32 // g.tp for g in runnable)


def test_planner_imports_without_torch_or_ray():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
            "import hybridflow.planner, hybridflow.planner.brute, hybridflow.planner.diagnose\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]")
    subprocess.run([sys.executable, "-c", code], check=True)
