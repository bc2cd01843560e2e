"""Another system's engines, priced by what they do (simulator/vocabulary/mechanics.py), on hand-computed values:
the Mechanics a plan names (validation, describe), a static generation batch capping the decode waves' batch,
HF generate under ZeRO-3 gathering the shards at every pass, DS-Chat's one generation (and switch) per PPO
mini-batch and NeMo-Aligner's slower generation loop as price_op applies them to a Plan. The mechanics that move
states and weights (optimizer offload, per-tensor sync, the Hybrid Engine's gather) are
test_state_moving_mechanics.py's."""

import pytest
from pricing_toys import LINKS, M_BYTES, PARAMS, TOY, cluster, mech_plan
from pydantic import ValidationError

from hybridflow.simulator import ParallelConfig, Plan, Workload
from hybridflow.simulator.pricing import generation
from hybridflow.simulator.pricing.cost import CostModel, price_op
from hybridflow.simulator.pricing.efficiency import EfficiencyParams
from hybridflow.simulator.pricing.plan_memory import kv_free_bytes
from hybridflow.simulator.pricing.reshard import HYBRID_ENGINE, IN_PLACE
from hybridflow.simulator.vocabulary.mechanics import Mechanics

KV_SEQ_16 = 16 * 2 * 2 * 4 * 16 * 2  # a 16-token sequence's KV cache: tokens · k,v · layers · heads · dim · bf16


def test_the_toy_shape_by_hand():
    assert TOY.num_params() == PARAMS and TOY.num_tensors() == 2 * 9 + 3
    assert TOY.kv_bytes_per_token() * 16 == KV_SEQ_16


# ---- Mechanics ----------------------------------------------------------------------------------------
def test_static_batching_needs_a_generation_batch():
    with pytest.raises(ValidationError, match="static batching needs a generation_batch"):
        Mechanics(batching="static")
    assert Mechanics(batching="static", generation_batch=4).generation_batch == 4


def test_continuous_batching_refuses_a_generation_batch():
    with pytest.raises(ValidationError, match="continuous batching fills the KV cache"):
        Mechanics(generation_batch=4)
    with pytest.raises(ValidationError):
        Mechanics(decode_slowdown=0.5)  # a loop faster than the serving engine is no slowdown
    with pytest.raises(ValidationError):
        Mechanics(system="trl")
    with pytest.raises(ValidationError):
        Mechanics(gather_evry_step=True)  # extra="forbid": a misspelt mechanic is an error, not a default


def test_the_default_mechanics_are_hybridflows_own():
    m = Mechanics()
    assert m.is_default and m.describe() == "hybridflow"
    assert (m.system, m.batching, m.generation_batch, m.gather_every_step, m.generate_per_minibatch,
            m.weight_sync, m.decode_slowdown) == ("hybridflow", "continuous", None, False, False, "bucketed", 1.0)
    assert Plan.model_fields["mechanics"].default == m and Plan.model_fields["optimizer_offload"].default is False
    for changed in (Mechanics(system="openrlhf"), Mechanics(weight_sync="per-tensor"), Mechanics(decode_slowdown=2),
                    Mechanics(generate_per_minibatch=True), Mechanics(gather_every_step=True)):
        assert not changed.is_default


def test_describe_names_every_mechanic_that_differs():
    every = Mechanics(system="deepspeed-chat", batching="static", generation_batch=4, gather_every_step=True,
                      generate_per_minibatch=True, weight_sync="per-tensor", decode_slowdown=6.96)
    assert every.describe() == ("deepspeed-chat, static generation batch 4, ZeRO-3 gather every decode step, "
                                "one generation per mini-batch, per-tensor weight sync, "
                                "generation loop 6.96x a serving engine's time")
    assert Mechanics(system="openrlhf", weight_sync="per-tensor").describe() == "openrlhf, per-tensor weight sync"


# ---- batch_cap: a static engine's batch per call --------------------------------------------------------
def waves_workload(prompts=20):
    return Workload(prompts=prompts, prompt_len=8, response_len=8)  # 16-token sequences


@pytest.mark.parametrize(("cap", "expected"), [
    (None, (10, 1, 10)),  # 10 sequences per replica (20 on dp=2): one wave, the KV cache holds them all
    (100, (10, 1, 10)),  # a cap above what the replica is given changes nothing
    (6, (10, 2, 5)),  # two waves, balanced 5 + 5
    (4, (10, 3, 4)),  # three waves of at most 4: 4 + 3 + 3, the balanced batch 4
    (3, (10, 4, 3)),
    (1, (10, 10, 1)),
])
def test_batch_cap_caps_the_wave_batch_and_raises_the_waves(cap, expected):
    cm = CostModel(cluster())
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, None, batch_cap=cap) == expected


def test_batch_cap_never_raises_the_batch_over_what_the_kv_cache_holds():
    cm = CostModel(cluster())
    free = 3 * KV_SEQ_16 + 1  # room for three sequences' KV cache
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, free) == (10, 4, 3)
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, free, batch_cap=5) == (10, 4, 3)
    assert generation.decode_waves(cm, TOY, ParallelConfig(dp=2), waves_workload(), 20, free, batch_cap=2) == (10, 5, 2)


def test_generate_with_a_batch_cap_pays_each_waves_passes():
    cm = CostModel(cluster())
    w, gen = waves_workload(), ParallelConfig(dp=2)
    ovh = cm.params.decode_step_overhead
    free, capped = cm.generate(TOY, gen, w), cm.generate(TOY, gen, w, batch_cap=4)
    # the prefill and 7 decode steps per wave, a step's fixed overhead each: 1 wave against 3
    assert free.breakdown["overhead"] == pytest.approx(1 * 8 * ovh)
    assert capped.breakdown["overhead"] == pytest.approx(3 * 8 * ovh)
    assert capped.seconds > free.seconds
    assert capped.flops == free.flops  # the same sequences, the same work: only how they are batched differs


# ---- gather_every_step: HF generate under ZeRO-3 -------------------------------------------------------
@pytest.mark.parametrize(("cap", "waves"), [(None, 1), (1, 2)])
def test_gather_every_step_all_gathers_the_model_at_every_pass(cap, waves):
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    w = Workload(prompts=8, prompt_len=8, response_len=4)  # 2 sequences per replica on dp=4
    gen = ParallelConfig(dp=4)
    plain = cm.generate(TOY, gen, w, batch_cap=cap)
    zero3 = cm.generate(TOY, gen, w, batch_cap=cap, gather_every_step=True)
    passes = waves * 4  # each wave's prefill and its 3 decode steps
    # a ring all-gather of the bf16 model over the 4 ranks at 5 GB/s per pass; 10 us per layer per pass
    assert zero3.breakdown["dp_gather"] == pytest.approx(passes * 0.75 * M_BYTES / 5e9)
    assert zero3.breakdown["latency"] - plain.breakdown.get("latency", 0.0) == pytest.approx(passes * 2 * 1e-5)
    assert "dp_gather" not in plain.breakdown
    assert zero3.seconds - plain.seconds == pytest.approx(passes * (0.75 * M_BYTES / 5e9 + 2 * 1e-5))
    assert zero3.flops == plain.flops


def test_gather_every_step_on_one_replica_gathers_nothing():
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    w = Workload(prompts=8, prompt_len=8, response_len=4)
    for gen in (ParallelConfig(), ParallelConfig(tp=2)):
        plain, zero3 = (cm.generate(TOY, gen, w, gather_every_step=g) for g in (False, True))
        assert zero3.breakdown == plain.breakdown and zero3.seconds == plain.seconds


def test_gather_every_step_over_dp_of_a_tensor_parallel_layout_gathers_the_tp_shard():
    cm = CostModel(cluster(), EfficiencyParams(**LINKS))
    w = Workload(prompts=8, prompt_len=8, response_len=4)  # 4 sequences per replica: one wave
    gen = ParallelConfig(tp=2, dp=2)  # the dp group (0, 2): a ring of 2 over the tp shard M/2
    zero3 = cm.generate(TOY, gen, w, gather_every_step=True)
    assert zero3.breakdown["dp_gather"] == pytest.approx(4 * 0.5 * (M_BYTES / 2) / 5e9)


# ---- price_op: a plan's mechanics ------------------------------------------------------------------------


def test_a_plans_mechanics_round_trip_and_default():
    plan = mech_plan(Mechanics(system="deepspeed-chat", generate_per_minibatch=True, decode_slowdown=2.0))
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert mech_plan().mechanics.is_default


def test_generate_per_minibatch_generates_each_minibatchs_share_and_switches_each_time():
    cm = CostModel(cluster())
    base, per_mb = mech_plan(), mech_plan(Mechanics(generate_per_minibatch=True))
    model, gen, w = base.roles["actor"].model, base.generation_config(), base.workload
    free = kv_free_bytes(per_mb, cm.params)
    one_call = cm.generate(model, gen, w, 16 // 4, free)  # a quarter of the 16 sequences
    got = price_op(cm, per_mb, "generate", "actor")
    assert got.seconds == pytest.approx(4 * one_call.seconds)
    assert got.flops == pytest.approx(4 * one_call.flops) and got.bytes == pytest.approx(4 * one_call.bytes)
    assert got.breakdown == pytest.approx({k: 4 * v for k, v in one_call.breakdown.items()})
    # the default: one call of all 16
    assert price_op(cm, base, "generate", "actor").seconds == pytest.approx(
        cm.generate(model, gen, w, 16, kv_free_bytes(base, cm.params)).seconds)
    # the switch into the generation layout (and back) is paid once per mini-batch
    switch = cm.reshard(model, base.roles["actor"].train, gen, base.weight_sync_mode())
    assert switch.seconds > 0
    assert price_op(cm, base, "reshard", "actor").seconds == pytest.approx(switch.seconds)
    assert price_op(cm, per_mb, "reshard", "actor").seconds == pytest.approx(4 * switch.seconds)
    assert price_op(cm, per_mb, "reshard", "actor").bytes == pytest.approx(4 * switch.bytes)
    # training is not touched
    for op, role in (("actor_update", "actor"), ("critic_update", "critic"), ("actor_logprob", "actor")):
        assert price_op(cm, per_mb, op, role).seconds == price_op(cm, base, op, role).seconds


def test_generate_per_minibatch_with_one_minibatch_is_one_call():
    cm = CostModel(cluster())
    one, per_mb = mech_plan(mini_batches=1), mech_plan(Mechanics(generate_per_minibatch=True), mini_batches=1)
    for op in ("generate", "reshard"):
        assert price_op(cm, per_mb, op, "actor").seconds == pytest.approx(price_op(cm, one, op, "actor").seconds)


def test_decode_slowdown_multiplies_the_generate_op_only():
    cm = CostModel(cluster())
    base, slow = mech_plan(), mech_plan(Mechanics(decode_slowdown=6.96))
    g0, g1 = price_op(cm, base, "generate", "actor"), price_op(cm, slow, "generate", "actor")
    assert g1.seconds == pytest.approx(6.96 * g0.seconds)
    assert g1.breakdown == pytest.approx({k: 6.96 * v for k, v in g0.breakdown.items()})
    for op, role in (("reshard", "actor"), ("actor_update", "actor"), ("ref_logprob", "ref"), ("values", "critic")):
        assert price_op(cm, slow, op, role).seconds == price_op(cm, base, op, role).seconds
    # with one generation per mini-batch as well: m calls of 1/m of the sequences, each `slowdown` times slower
    both = mech_plan(Mechanics(generate_per_minibatch=True, decode_slowdown=2.0))
    one_call = cm.generate(base.roles["actor"].model, base.generation_config(), base.workload, 4,
                           kv_free_bytes(both, cm.params))
    assert price_op(cm, both, "generate", "actor").seconds == pytest.approx(2.0 * 4 * one_call.seconds)


def test_a_static_batch_and_zero3_generation_reach_the_generate_op():
    cm = CostModel(cluster())
    base = mech_plan()
    static = mech_plan(Mechanics(batching="static", generation_batch=2))
    zero3 = mech_plan(Mechanics(batching="static", generation_batch=2, gather_every_step=True))
    model, gen, w = base.roles["actor"].model, base.generation_config(), base.workload
    free = kv_free_bytes(static, cm.params)
    assert price_op(cm, static, "generate", "actor").seconds == pytest.approx(
        cm.generate(model, gen, w, 16, free, batch_cap=2).seconds)
    assert price_op(cm, zero3, "generate", "actor").seconds == pytest.approx(
        cm.generate(model, gen, w, 16, kv_free_bytes(zero3, cm.params), batch_cap=2, gather_every_step=True).seconds)
    assert "dp_gather" in price_op(cm, zero3, "generate", "actor").breakdown
    assert price_op(cm, static, "generate", "actor").seconds > price_op(cm, base, "generate", "actor").seconds


def test_a_plans_weight_sync_mode_follows_its_mechanics():
    assert mech_plan().weight_sync_mode() == "hybridflow"
    assert mech_plan(Mechanics(gather_every_step=True)).weight_sync_mode() == IN_PLACE
    assert mech_plan(Mechanics(system="deepspeed-chat")).weight_sync_mode() == HYBRID_ENGINE
    # ZeRO-3 generation wins over DS-Chat's Hybrid Engine: nothing is switched
    assert mech_plan(Mechanics(system="deepspeed-chat", gather_every_step=True)).weight_sync_mode() == IN_PLACE
    cm = CostModel(cluster())
    assert price_op(cm, mech_plan(Mechanics(gather_every_step=True)), "reshard", "actor").seconds == 0.0
    he = mech_plan(Mechanics(system="deepspeed-chat", generate_per_minibatch=True))
    rp = he.roles["actor"]
    assert price_op(cm, he, "reshard", "actor").seconds == pytest.approx(
        4 * cm.reshard(rp.model, rp.train, he.generation_config(), HYBRID_ENGINE).seconds)
