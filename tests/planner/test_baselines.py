"""Baseline systems as Plans, priced by the same simulator; a baseline that does not fit says why."""

import math

import pytest

from hybridflow.planner.baselines import (
    SystemSettings,
    ds_chat,
    hybridflow_v,
    nemo_aligner,
    openrlhf,
    openrlhf_colocated,
)
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import Planner
from hybridflow.simulator import ClusterSpec, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.baseline_mechanics import hf_generate_slowdown
from hybridflow.simulator.pricing.cost import price_op
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.schedule.schedule import simulate

WL = Workload(prompts=256, prompt_len=512, response_len=512)


def _req(model="llama2-7b", nodes=2, algo="ppo", wl=WL):
    c = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=nodes, devices_per_node=8)
    return SearchRequest.for_algorithm(algo, model_preset(model), c, wl)


@pytest.fixture(scope="module")
def searched():
    req = _req()
    planner = Planner(req)
    return req, planner, planner.run()


def _priced_like_simulate(b, cm):
    assert b.fits, b.reason
    assert all(m.fits for m in plan_memory(b.plan).values())
    assert math.isclose(simulate(b.plan, cm).iteration_seconds(), b.seconds, rel_tol=1e-12)


def test_ds_chat_is_all_colocated_zero3_with_full_gather(searched):
    req, planner, res = searched
    b = ds_chat(req, planner.cm)
    _priced_like_simulate(b, planner.cm)
    assert b.plan.reshard == "ds-chat" and len(b.plan.groups) == 1
    assert all(rp.train.dp == 16 and rp.train.tp == rp.train.pp == 1 for rp in b.plan.roles.values())
    # the Hybrid Engine: one generation (and switch) per mini-batch, each device its share of the mini-batch
    mech = b.plan.mechanics
    assert mech.system == "deepspeed-chat" and mech.generate_per_minibatch and mech.batching == "static"
    assert mech.generation_batch == WL.prompts // (WL.mini_batches * 16)
    assert b.plan.weight_sync_mode() == "hybrid-engine"
    assert b.seconds >= res.best.seconds  # the search covers DS-Chat's layout with a cheaper reshard


def test_ds_chat_without_hybrid_engine_gathers_every_step_and_is_slower(searched):
    req, planner, _ = searched
    he = ds_chat(req, planner.cm)
    z3 = ds_chat(req, planner.cm, SystemSettings(hybrid_engine=False, generation_batch=8))
    _priced_like_simulate(z3, planner.cm)
    assert z3.plan.mechanics.gather_every_step and z3.plan.weight_sync_mode() == "in-place"
    he_gen, z3_gen = (simulate(b.plan, planner.cm).op_seconds()["generate"] for b in (he, z3))
    assert z3_gen > 2 * he_gen  # 512 decode steps each gathering the whole model over 16 devices
    # OpenRLHF's DeepSpeed trainer without Ray is the same layout under its own name
    assert openrlhf_colocated(req, planner.cm).plan.mechanics.gather_every_step


def test_ds_chat_raises_inference_tp_until_the_actor_fits():
    req = _req("llama2-70b", nodes=8, wl=Workload())
    b = ds_chat(req, Planner(req).cm)
    assert b.fits and b.plan.generation_config().tp > 1
    pinned = ds_chat(req, Planner(req).cm, SystemSettings(inference_tp=1))
    assert not pinned.fits and "GiB" in pinned.reason


def test_openrlhf_separate_groups_and_rollout(searched):
    req, planner, _ = searched
    b = openrlhf(req, planner.cm)
    _priced_like_simulate(b, planner.cm)
    p = b.plan
    assert p.reshard == "broadcast" and p.roles["actor"].generate_group == "rollout"
    groups = {rp.group for rp in p.roles.values()}
    assert len(groups) == len(p.roles)  # every model on devices of its own
    assert sum(len(g.devices) for g in p.groups) == 16
    assert all(rp.train.tp == rp.train.pp == 1 for rp in p.roles.values())
    assert p.roles["actor"].generate.pp == 1
    assert p.mechanics.weight_sync == "per-tensor" and p.mechanics.generation_batch == 16


def test_openrlhf_takes_a_stated_split_and_needs_adam_offload_for_13b_on_two_devices():
    c = ClusterSpec(hardware=hardware_preset("a800-80g"), nodes=1, devices_per_node=8)
    req = SearchRequest.for_algorithm("ppo", model_preset("llama2-13b"), c, WL)
    split = dict(ref=1, reward=1, actor=2, critic=2, rollout=2)
    plain = openrlhf(req, Planner(req).cm, SystemSettings(split=split))
    assert not plain.fits and "optimizer" in plain.reason
    off = openrlhf(req, Planner(req).cm, SystemSettings(split=split, optimizer_offload=True))
    assert off.fits and off.plan.optimizer_offload
    assert {r: len(off.plan.group(rp.group).devices) for r, rp in off.plan.roles.items()} == {
        "actor": 2, "critic": 2, "ref": 1, "reward": 1}
    assert len(off.plan.group("rollout").devices) == 2
    bad = openrlhf(req, Planner(req).cm, SystemSettings(split=dict(split, rollout=1)))
    assert not bad.fits and "split" in bad.reason


def test_nemo_aligner_halves_and_no_reshard(searched):
    req, planner, res = searched
    b = nemo_aligner(req, planner.cm)
    _priced_like_simulate(b, planner.cm)
    assert sorted(map(sorted, b.plan.placement())) == [["actor", "ref"], ["critic", "reward"]]
    actor = b.plan.roles["actor"]
    g, t = actor.generate, actor.train
    assert (g.tp, g.pp, g.dp) == (t.tp, t.pp, t.dp) and t.backend == "megatron"
    mech = b.plan.mechanics
    assert mech.batching == "static" and mech.generation_batch == 8
    # Megatron's eager loop, priced on the plan itself (simulator/pricing/baseline_mechanics.py)
    serving = b.plan.model_copy(update={"mechanics": mech.model_copy(update={"decode_slowdown": 1.0})})
    assert mech.decode_slowdown == pytest.approx(hf_generate_slowdown(planner.cm, serving, "megatron"))
    assert mech.decode_slowdown > 1.0
    assert [len(g.devices) for g in b.plan.groups] == [8, 8]
    assert b.seconds >= res.best.seconds * (1 - 1e-12)


def test_hybridflow_v_keeps_our_placement(searched):
    req, planner, res = searched
    b = hybridflow_v(req, planner.cm, res.best)
    _priced_like_simulate(b, planner.cm)
    assert b.plan.reshard == "hybridflow-v"
    assert [sorted(s) for s in b.plan.placement()] == [sorted(s) for s in res.best.placement]
    assert b.seconds >= res.best.seconds * (1 - 1e-12)


def test_baselines_that_cannot_fit_say_why():
    req = _req("llama2-70b", nodes=4, wl=Workload())
    planner = Planner(req)
    res = planner.run()
    b = ds_chat(req, planner.cm)
    assert not b.fits and "GiB" in b.reason and b.seconds is None
    assert b.json() == {"fits": False, "reason": b.reason}
    v = hybridflow_v(req, planner.cm, res.best)
    assert v.fits or ("fit" in v.reason and v.json()["fits"] is False)


def test_grpo_nemo_has_reward_on_the_other_half():
    req = _req(algo="grpo", nodes=1)
    planner = Planner(req)
    b = nemo_aligner(req, planner.cm)
    _priced_like_simulate(b, planner.cm)
    assert sorted(map(sorted, b.plan.placement())) == [["actor", "ref"], ["reward"]]


def test_ds_chat_with_a_zero2_actor_generates_on_local_replicas_in_the_eager_loop(searched):
    """DS-Chat as OpenRLHF's benchmark ran it (--actor_zero_stage 2, no Hybrid Engine): no gather at any step; the
    generate op is the serving engine's price times the eager loop's slowdown, which is above 1."""
    req, planner, _ = searched
    b = ds_chat(req, planner.cm, SystemSettings(hybrid_engine=False, actor_zero_stage=2, generation_batch=8))
    _priced_like_simulate(b, planner.cm)
    mech = b.plan.mechanics
    assert not mech.gather_every_step and mech.generation_batch == 8
    serving = b.plan.model_copy(update={"mechanics": mech.model_copy(update={"decode_slowdown": 1.0})})
    assert mech.decode_slowdown == pytest.approx(hf_generate_slowdown(planner.cm, serving, "hf-eager"))
    assert mech.decode_slowdown > 1.0
    got = price_op(planner.cm, b.plan, "generate", "actor").seconds
    assert got == pytest.approx(mech.decode_slowdown * price_op(planner.cm, serving, "generate", "actor").seconds)
    zero3 = ds_chat(req, planner.cm, SystemSettings(hybrid_engine=False, actor_zero_stage=3, generation_batch=8))
    assert zero3.plan.mechanics.gather_every_step and zero3.seconds > b.seconds  # ZeRO-3 also gathers every step


def test_ds_chat_hybrid_engine_loop_is_priced_with_its_own_layer_cost(searched):
    req, planner, _ = searched
    b = ds_chat(req, planner.cm)
    mech = b.plan.mechanics
    assert mech.generate_per_minibatch
    serving = b.plan.model_copy(update={"mechanics": mech.model_copy(update={"decode_slowdown": 1.0})})
    assert mech.decode_slowdown == pytest.approx(hf_generate_slowdown(planner.cm, serving, "hybrid-engine"))
