"""Transfer protocols: split and gather round-trip a batch, in the driver alone and through a real
worker group of 4 virtual devices with 1-D and 3-D layouts (including sizes that do not divide)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import (
    PROTOCOLS,
    Protocol,
    get_protocol,
    register,
    register_protocol,
    split_call,
)
from hybridflow.runtime.controller.worker import Worker
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

LAYOUTS = [ParallelConfig(dp=4), ParallelConfig(dp=2, tp=2), ParallelConfig(pp=2, dp=2), ParallelConfig(pp=2, tp=2)]

# A user-defined protocol: everyone gets everything, the driver keeps the last rank's answer.
register_protocol(Protocol("LAST_RANK", lambda v, p: ([v] * p.world_size, {}), lambda outs, p, info: outs[0],
                           lambda p: [p.world_size - 1]))


def batch(n: int) -> Batch:
    return Batch({"x": torch.arange(n * 2, dtype=torch.float32).view(n, 2)},
                 non_tensors={"prompt": [f"q{i}" for i in range(n)]}, meta={"step": 1})


def simulate(name: str, parallel: ParallelConfig, value):
    """Split in the driver, let each rank 'compute' the identity, gather: the protocol alone."""
    proto = get_protocol(name)
    per_rank, info = split_call(proto, parallel, (value,), {})
    outs = [a[0] for a, _ in per_rank]
    return proto.gather([outs[r] for r in proto.collect_ranks(parallel)], parallel, info), outs


@pytest.mark.parametrize("parallel", LAYOUTS, ids=str)
@pytest.mark.parametrize("n", [8, 5, 3, 1])
def test_every_protocol_round_trips_in_the_driver(parallel, n):
    b = batch(n)
    one, _ = simulate("ONE_TO_ALL", parallel, b)
    assert len(one) == parallel.world_size and all(x.equals(b) for x in one)
    assert simulate("RANK_ZERO", parallel, b)[0].equals(b)
    assert simulate("ALL_TO_ALL", parallel, b)[0].equals(b)
    assert simulate("LAST_RANK", parallel, b)[0].equals(b)
    for name in ("DP_COMPUTE", "3D_PROTO"):
        back, outs = simulate(name, parallel, b)
        assert back.equals(b)
        # every rank of one dp group holds the same shard; shards of dp groups differ (when n > 1)
        for r in range(parallel.world_size):
            same = [q for q in range(parallel.world_size) if parallel.rank_coords(q)[1] == parallel.rank_coords(r)[1]]
            assert all(outs[q].equals(outs[r]) for q in same)
        assert len(outs[0]) == -(-n // parallel.dp)


def test_dp_collects_tp0_of_last_stage_in_dp_order():
    p = ParallelConfig(pp=2, dp=3, tp=2)
    ranks = get_protocol("DP_COMPUTE").collect_ranks(p)
    assert [p.rank_coords(r) for r in ranks] == [(1, 0, 0), (1, 1, 0), (1, 2, 0)]


@pytest.mark.parametrize("n", [8, 5])
def test_dp_gives_the_ranks_of_a_sequence_parallel_group_the_same_shard(n):
    """sp = 2 of dp = 4 (tp 2): dp/sp = 2 shards, each on both dp ranks of its sp group; one rank per group collected."""
    p = ParallelConfig(tp=2, dp=4, sp=2)
    back, outs = simulate("DP_COMPUTE", p, batch(n))
    assert back.equals(batch(n))
    groups = [[q for q in range(p.world_size) if p.rank_coords(q)[1] // 2 == g] for g in range(2)]
    assert all(outs[q].equals(outs[grp[0]]) for grp in groups for q in grp)
    assert not outs[groups[0][0]].equals(outs[groups[1][0]]) and len(outs[0]) == -(-n // 2)
    assert [p.rank_coords(r) for r in get_protocol("DP_COMPUTE").collect_ranks(p)] == [(0, 0, 0), (0, 2, 0)]


def test_dp_splits_tensors_and_lists_and_broadcasts_the_rest():
    p = ParallelConfig(dp=2)
    per_rank, info = split_call(get_protocol("DP_COMPUTE"), p, (torch.arange(5), [1, 2, 3, 4, 5]), {"scale": 2.0})
    assert info == {"pad": 1}
    (t0, l0), k0 = per_rank[0]
    (t1, l1), _ = per_rank[1]
    assert t0.tolist() == [0, 1, 2] and t1.tolist() == [3, 4, 0] and l1 == [4, 5, 1] and k0 == {"scale": 2.0}


def test_dp_gathers_outputs_that_do_not_concatenate_as_a_list_per_dp_rank():
    p = ParallelConfig(pp=2, dp=2, tp=2)
    proto = get_protocol("DP_COMPUTE")
    outs = [{"loss": float(r)} for r in proto.collect_ranks(p)]
    assert proto.gather(outs, p, {"pad": 1}) == [{"loss": 4.0}, {"loss": 6.0}]


def test_arguments_of_different_sizes_are_refused():
    with pytest.raises(HflowError, match="same number of samples"):
        split_call(get_protocol("DP_COMPUTE"), ParallelConfig(dp=2), (batch(3), batch(4)), {})


def test_all_to_all_gives_list_items_per_rank():
    p = ParallelConfig(dp=3)
    back, outs = simulate("ALL_TO_ALL", p, ["a", "b", "c"])
    assert outs == ["a", "b", "c"] and back == ["a", "b", "c"]
    with pytest.raises(HflowError, match="one list item per rank"):
        simulate("ALL_TO_ALL", p, ["a"])


def test_unknown_protocol_is_a_one_line_error():
    with pytest.raises(HflowError, match="unknown transfer protocol 'DP'; known: .*DP_COMPUTE"):
        register("DP")
    assert {"ONE_TO_ALL", "ALL_TO_ALL", "RANK_ZERO", "DP_COMPUTE", "3D_PROTO"} <= set(PROTOCOLS)


# ---- through a real worker group -----------------------------------------------------------------
class Echo(Worker):
    """Returns its input with the rank that computed each sample."""

    def _tag(self, b: Batch) -> Batch:
        out = Batch(b.tensors.clone(), b.non_tensors, b.meta)
        out["rank"] = torch.full((len(b),), self.rank)
        return out

    @register("ONE_TO_ALL")
    def one_to_all(self, b):
        return self._tag(b)

    @register("ALL_TO_ALL")
    def all_to_all(self, b):
        return self._tag(b)

    @register("RANK_ZERO")
    def rank_zero(self, b):
        return self._tag(b)

    @register("DP_COMPUTE")
    def dp(self, b):
        return self._tag(b)

    @register("3D_PROTO")
    def proto3d(self, b):
        return self._tag(b)

    @register("LAST_RANK")
    def last(self, b):
        return self._tag(b)


ROLES = {"flat": ParallelConfig(dp=4), "dptp": ParallelConfig(dp=2, tp=2), "ppdp": ParallelConfig(pp=2, dp=2)}


@pytest.fixture(scope="module")
def echo_group(ray_local):
    from hybridflow.runtime.controller.resource_pool import ResourcePool
    from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup

    group = WorkerGroup(ResourcePool.local(4, name="echo"), {r: RoleSpec(Echo, p) for r, p in ROLES.items()})
    yield group
    group.shutdown()
    group.pool.remove()


@pytest.mark.ray
@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("n", [8, 5])
def test_every_protocol_round_trips_through_workers(echo_group, role, n):
    p, b, h = ROLES[role], batch(n), echo_group[role]
    outs = h.one_to_all(b)
    assert [o["rank"][0].item() for o in outs] == [0, 1, 2, 3]
    assert all(o.select("x", "prompt").equals(b) for o in outs)
    z = h.rank_zero(b)
    assert z.select("x", "prompt").equals(b) and set(z["rank"].tolist()) == {0}
    last = h.last(b)
    assert last.select("x", "prompt").equals(b) and set(last["rank"].tolist()) == {3}
    a2a = h.all_to_all(b)
    assert a2a.select("x", "prompt").equals(b)
    assert a2a["rank"].tolist() == [i // -(-n // 4) for i in range(n)]  # consecutive shards, padding dropped
    for method in (h.dp, h.proto3d):
        out = method(b)
        assert out.select("x", "prompt").equals(b)  # padding removed, order kept
        assert set(out["rank"].tolist()) <= set(get_protocol("DP_COMPUTE").collect_ranks(p))
        shard = -(-n // p.dp)
        assert out["rank"].tolist() == [get_protocol("DP_COMPUTE").collect_ranks(p)[i // shard] for i in range(n)]
