"""ZeRO-3 parameter offload (Mechanics.param_offload; CostModel.param_fetch) on hand-computed values: the rank's
shard of the bf16 weights copied from host memory at every pass of every micro-batch, added to the role's
forward and update ops by price_op and to no other op or role."""

import pytest
from pricing_toys import HW as TOY_GPU
from pricing_toys import PARAMS, TOY
from rl_util import tiny_plan

from hybridflow.simulator import ClusterSpec, ParallelConfig, Plan, Workload
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.op_cost import op_cost, plus
from hybridflow.simulator.vocabulary.mechanics import Mechanics

HW = TOY_GPU.model_copy(update={"host_bandwidth": 20e9})  # round figures: a 20 GB/s host link, used at half (10 GB/s)
HALF_LINK = EfficiencyParams(host_link_efficiency=0.5)


def test_plus_adds_two_prices_part_by_part():
    a = op_cost(10.0, 100.0, compute=1.0, host_copy=0.5)
    b = op_cost(0.0, 40.0, host_copy=0.25, host_gather=2.0)
    s = plus(a, b)
    assert s.breakdown == {"compute": 1.0, "host_copy": 0.75, "host_gather": 2.0}
    assert (s.seconds, s.flops, s.bytes) == (3.75, 10.0, 140.0)


def test_param_fetch_copies_the_ranks_shard_at_every_pass_of_every_micro_batch():
    cm = CostModel(ClusterSpec(hardware=HW, nodes=1, devices_per_node=8), HALF_LINK)
    w = Workload(prompts=64, prompt_len=8, response_len=8, micro_batch_size=2, mini_batches=2, ppo_epochs=2)
    par = ParallelConfig(dp=4, backend="deepspeed")
    shard = 2 * PARAMS / 4  # bf16 bytes of a rank's ZeRO-3 partition
    # training: 4 steps (2 epochs × 2 mini-batches) of 128/4 = 32 sequences, 8 per rank: 4 micro-batches of 2,
    # each fetched for its forward and its backward
    train = cm.param_fetch(TOY, "lm", par, w, sequences=128, steps=4, passes=2, micro_batch_tokens=None)
    assert train.breakdown == {"host_gather": pytest.approx(4 * 4 * 2 * shard / 10e9)}
    assert train.bytes == pytest.approx(4 * 4 * 2 * shard)
    # a forward over 64 sequences: 16 per rank, 8 micro-batches of 2, one fetch each
    fwd = cm.param_fetch(TOY, "lm", par, w, sequences=64, steps=1, passes=1, micro_batch_tokens=None)
    assert fwd.seconds == pytest.approx(8 * shard / 10e9)


def test_price_op_adds_the_fetches_to_the_offloaded_roles_forward_and_update_only():
    w = Workload(prompts=16, prompt_len=16, response_len=8, micro_batch_size=2, mini_batches=2)
    plan = tiny_plan("ppo", devices=[2, 1], train={"actor": ParallelConfig(tp=2), "ref": ParallelConfig(tp=2)},
                     generate=ParallelConfig(dp=2), workload=w)

    def with_mech(m):
        return Plan.model_validate({**plan.model_dump(), "mechanics": m.model_dump()})

    base = with_mech(Mechanics(system="deepspeed-chat"))
    off = with_mech(Mechanics(system="deepspeed-chat", param_offload=("critic",)))
    cm = CostModel(plan.cluster)
    critic = plan.roles["critic"]
    for op, steps, passes, seqs in (("values", 1, 1, w.sequences), ("critic_update", 2, 2, w.sequences)):
        a, b = price_op(cm, base, op, "critic"), price_op(cm, off, op, "critic")
        fetch = cm.param_fetch(critic.model, "scalar", critic.train, w, seqs, steps, passes, critic.micro_batch_tokens)
        assert "host_gather" not in a.breakdown and fetch.seconds > 0
        assert b.breakdown["host_gather"] == pytest.approx(fetch.seconds)
        assert b.seconds == pytest.approx(a.seconds + fetch.seconds)
    for op, role in (("actor_update", "actor"), ("ref_logprob", "ref"), ("generate", "actor")):
        assert price_op(cm, off, op, role).seconds == pytest.approx(price_op(cm, base, op, role).seconds)
    assert "parameters in host memory (critic)" in off.mechanics.describe()
