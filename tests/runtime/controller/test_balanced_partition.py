"""Data-parallel balance by tokens (controller/protocols.py balanced_partition, used by rl/batches.py
dp_balanced_order before the DP_COMPUTE dispatch): on a long-tail batch every rank gets the same number of rows
and the most- and least-loaded ranks differ by at most 10 % in tokens; the rows come back in the caller's order."""

from __future__ import annotations

import pytest
import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import balanced_partition, get_protocol, load_spread
from hybridflow.runtime.engines.train.packing import inverse_order
from hybridflow.runtime.rl.batches import dp_balanced_order
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.lengths import LengthDistribution
from hybridflow.simulator.vocabulary.parallel import ParallelConfig

LONG_TAIL = LengthDistribution.model_validate({"mean": 250, "max": 2000})  # the maximum 8× the mean


def _lengths(n: int, seed: int) -> list[int]:
    """n response lengths from the long tail, in a seeded random order, behind prompts of 20-60 tokens."""
    g = torch.Generator().manual_seed(seed)
    responses = torch.tensor(LONG_TAIL.sample(n))[torch.randperm(n, generator=g)]
    return (responses + torch.randint(20, 61, (n,), generator=g)).tolist()


@pytest.mark.parametrize("n,dp", [(64, 2), (64, 4), (128, 8), (256, 8)])
def test_long_tail_ranks_within_ten_percent(n, dp):
    for seed in range(5):
        lengths = _lengths(n, seed)
        parts = balanced_partition(lengths, dp)
        assert sorted(i for p in parts for i in p) == list(range(n)) and {len(p) for p in parts} == {n // dp}
        assert load_spread(lengths, parts) <= 0.10, (seed, load_spread(lengths, parts))
        assert parts == balanced_partition(lengths, dp)  # deterministic
        contiguous = [list(range(r * n // dp, (r + 1) * n // dp)) for r in range(dp)]
        assert load_spread(lengths, parts) <= load_spread(lengths, contiguous)


def test_dispatch_balances_ranks_and_returns_rows_in_order():
    """What the Dataflow does (rl/dataflow.py _call_balanced): reorder, split by DP_COMPUTE, compute per rank,
    gather, and put the rows back."""
    n, parallel = 64, ParallelConfig(dp=4)
    lengths = torch.tensor(_lengths(n, seed=7))
    width = int(lengths.max())
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()  # left-padded
    batch = Batch({"attention_mask": mask, "row": torch.arange(n)})
    order = dp_balanced_order(mask, parallel.dp)
    protocol = get_protocol("DP_COMPUTE")
    shards, info = protocol.split(batch[order], parallel)
    tokens = [int(s["attention_mask"].sum()) for s in shards]
    assert (max(tokens) - min(tokens)) / max(tokens) <= 0.10
    contiguous = [int(mask[r * 16:(r + 1) * 16].sum()) for r in range(4)]
    assert (max(contiguous) - min(contiguous)) / max(contiguous) > 0.10  # the plain split would not be balanced
    outputs = [Batch({"row": s["row"], "tokens": s["attention_mask"].sum(-1)}) for s in shards]
    back = protocol.gather(outputs, parallel, info)[inverse_order(order)]
    assert back["row"].tolist() == list(range(n)) and back["tokens"].tolist() == lengths.tolist()


def test_prompt_groups_stay_together():
    """GRPO's samples of a prompt (consecutive rows) go to one rank, balanced by their total tokens."""
    lengths = torch.tensor(_lengths(64, seed=3))
    mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()
    order = dp_balanced_order(mask, 2, group=4)
    for shard in order.view(2, -1):
        assert {int(r) // 4 for r in shard}.__len__() * 4 == shard.numel()


def test_parts_that_do_not_divide_the_rows_are_one_line():
    with pytest.raises(HflowError, match="cannot cut 10 rows into 4 equal parts") as e:
        balanced_partition(list(range(10)), 4)
    assert "\n" not in str(e.value)
