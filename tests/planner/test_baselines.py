"""Baseline systems as Plans, priced by the same simulator; a baseline that does not fit says why."""

import math

import pytest

from hybridflow.planner.baselines import ds_chat, hybridflow_v, nemo_aligner, openrlhf
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import Planner
from hybridflow.simulator import ClusterSpec, Workload, hardware_preset, model_preset
from hybridflow.simulator.pricing.memory import plan_memory
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
    assert b.seconds >= res.best.seconds  # the search covers DS-Chat's layout with a cheaper reshard


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


def test_nemo_aligner_halves_and_no_reshard(searched):
    req, planner, res = searched
    b = nemo_aligner(req, planner.cm)
    _priced_like_simulate(b, planner.cm)
    assert sorted(map(sorted, b.plan.placement())) == [["actor", "ref"], ["critic", "reward"]]
    actor = b.plan.roles["actor"]
    assert actor.generate == actor.train
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
    req = _req("llama2-70b", nodes=16, wl=Workload())
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
