"""Scoring per generate call (Mechanics.score_per_call, OpenRLHF's make_experience): a small OpenRLHF-shaped PPO plan
scheduled on hand-set op seconds, its interleaved makespan computed by hand."""

import pytest

from hybridflow.simulator import ClusterSpec, Device, DeviceGroup, ParallelConfig, Plan, RolePlan, Workload
from hybridflow.simulator.schedule.dataflow import unroll
from hybridflow.simulator.schedule.per_call import SCORES_AWAITED, calls_per_rank, interleave_scoring
from hybridflow.simulator.schedule.schedule import makespan, plan_dataflow, schedule, simulate
from hybridflow.simulator.vocabulary.mechanics import Mechanics
from hybridflow.simulator.vocabulary.model import model_preset

# the whole op's seconds: generate is one engine's 2 calls; the scoring ops are over the whole batch
HAND = {"generate": 40.0, "actor_logprob": 4.0, "ref_logprob": 8.0, "values": 4.0, "reward": 8.0}


def openrlhf_shaped(score_per_call: bool = True) -> Plan:
    """OpenRLHF's 7B split on 8 GPUs (ref 1, reward 1, actor 2, critic 2, vLLM 2 engines of 1), 64 prompts in calls
    of 16: 2 actor ranks, 2 calls each, rank r on engine r; the ref and reward serve both ranks one after the other."""
    m = model_preset("llama2-7b")
    dev = [Device(node=0, index=i) for i in range(8)]
    sizes = {"ref": 1, "reward": 1, "actor": 2, "critic": 2, "rollout": 2}
    groups, at = [], 0
    for name, n in sizes.items():
        groups.append(DeviceGroup(name=name, devices=dev[at:at + n]))
        at += n
    roles = {r: RolePlan(model=m, group=r, train=ParallelConfig(dp=sizes[r]),
                         **({"generate_group": "rollout", "generate": ParallelConfig(dp=2)} if r == "actor" else {}))
             for r in ("actor", "critic", "ref", "reward")}
    mech = Mechanics(system="openrlhf", batching="static", generation_batch=16, drain_calls=True,
                     score_per_call=score_per_call)
    return Plan(algorithm="ppo", cluster=ClusterSpec(hardware="a800-80g", nodes=1, devices_per_node=8),
                workload=Workload(prompts=64, prompt_len=256, response_len=256), groups=groups, roles=roles,
                reshard="broadcast", mechanics=mech)


def _hand_times(plan: Plan):
    graph, lanes = plan_dataflow(plan)
    big, big_lanes = unroll(graph, lanes, 1)
    if plan.mechanics.score_per_call:
        interleave_scoring(plan, big, big_lanes)
    seconds = {n: HAND.get(a["op"], 0.0) * a.get("share", 1.0) for n, a in big.nodes(data=True)}
    return big, schedule(big, big_lanes, seconds)


def _experience_end(big, times) -> float:
    return max(times[n][1] for n, a in big.nodes(data=True) if a["op"] in HAND)


def test_calls_and_shares():
    plan = openrlhf_shaped()
    assert calls_per_rank(plan) == (2, 2)
    big, _ = _hand_times(plan)
    shares = {}
    for _, a in big.nodes(data=True):
        if "share" in a:
            shares.setdefault(a["op"], []).append(a["share"])
    # 2 ranks × 2 calls on 2 engines: each call half an engine's price; the actor and critic (2 ranks) score
    # both ranks' batches in one collective per call; the 1-GPU ref and reward take each rank's batch alone
    assert sorted(shares["generate"]) == [0.5] * 4
    assert shares["actor_logprob"] == shares["values"] == [0.5, 0.5]
    assert shares["ref_logprob"] == shares["reward"] == [0.25] * 4


def test_interleaved_makespan_by_hand():
    # call 0: both engines 0–20; the actor and critic waves 20–22, ref and reward rank 0's 20–22, rank 1's 22–24.
    # Rank 0 generates again 22–42, rank 1 24–44 (it waited for the shared ref and reward). Call 1: rank 0's ref
    # and reward 42–44 while rank 1 still generates; the actor and critic collectives wait for rank 1: 44–46, as do
    # rank 1's ref and reward. Scoring after the whole generation would end at 40 + max(4, 8, 4, 8) = 48.
    big, times = _hand_times(openrlhf_shaped())
    assert _experience_end(big, times) == pytest.approx(46.0)
    calls = sorted(times[n] for n, a in big.nodes(data=True) if a["op"] == "generate")
    assert calls == [(0.0, 20.0), (0.0, 20.0), (22.0, 42.0), (24.0, 44.0)]
    refs = sorted(times[n] for n, a in big.nodes(data=True) if a["op"] == "ref_logprob")
    assert refs == [(20.0, 22.0), (22.0, 24.0), (42.0, 44.0), (44.0, 46.0)]
    whole_big, whole_times = _hand_times(openrlhf_shaped(score_per_call=False))
    assert _experience_end(whole_big, whole_times) == pytest.approx(48.0)
    assert makespan(times) == pytest.approx(46.0)  # advantage and updates are free here


def test_timeline_merges_a_rounds_calls_and_shows_the_wait():
    tl = simulate(openrlhf_shaped())
    gens = [e for e in tl.events if e.op == "generate"]
    assert len(gens) == 2 and all(e.group == "rollout" for e in gens)  # one event per round of calls
    first, second = sorted(gens, key=lambda e: e.start)
    assert first.breakdown[SCORES_AWAITED] == pytest.approx(0.0)
    call = first.seconds
    # the second round: rank 1 starts after rank 0, late by its wait for the shared ref's and reward's second batch
    lag = second.seconds - call
    assert lag > 0 and second.breakdown[SCORES_AWAITED] == pytest.approx(lag)
    assert sum(second.breakdown.values()) == pytest.approx(second.seconds)
    # the op totals keep the work: four ref batches are the whole ref op
    whole = simulate(openrlhf_shaped(score_per_call=False))
    for op in ("ref_logprob", "reward", "values", "actor_logprob"):
        assert tl.op_seconds()[op] == pytest.approx(whole.op_seconds()[op])
    assert tl.op_seconds()["generate"] == pytest.approx(whole.op_seconds()["generate"] + lag)
    assert tl.iteration_seconds() < whole.iteration_seconds()
