import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.simulator.schedule.dataflow import build_dataflow, call_order, lanes_tuple
from hybridflow.simulator.schedule.schedule import makespan, schedule


def chain_free(nodes):
    g = nx.DiGraph()
    for i, n in enumerate(nodes):
        g.add_node(n, order=i)
    return g


def test_two_ops_on_one_group_serialize_in_call_order():
    g = chain_free(["a", "b"])
    t = schedule(g, {"a": "G", "b": "G"}, {"a": 2.0, "b": 3.0})
    assert t == {"a": (0.0, 2.0), "b": (2.0, 5.0)}


def test_two_ops_on_disjoint_groups_overlap():
    g = chain_free(["a", "b"])
    t = schedule(g, {"a": "G1", "b": "G2"}, {"a": 2.0, "b": 3.0})
    assert t == {"a": (0.0, 2.0), "b": (0.0, 3.0)}
    assert makespan(t) == 3.0


def test_an_op_waits_for_its_inputs_on_another_group():
    g = chain_free(["a", "b", "c"])
    g.add_edge("a", "c")
    t = schedule(g, {"a": "G1", "b": "G2", "c": "G2"}, {"a": 5.0, "b": 1.0, "c": 1.0})
    assert t["c"] == (5.0, 6.0)


def test_an_op_on_two_groups_holds_both():
    g = chain_free(["a", "bcast", "c"])
    g.add_edge("bcast", "c")
    t = schedule(g, {"a": "G1", "bcast": ("G1", "G2"), "c": "G2"}, {"a": 4.0, "bcast": 1.0, "c": 2.0})
    assert t["bcast"] == (4.0, 5.0) and t["c"] == (5.0, 7.0)


def test_ppo_split_placement_overlaps_critic_work_with_the_actor():
    g = build_dataflow("ppo", ["actor", "critic", "ref", "reward"], reward_model=True, cost_model=False,
                       hybrid_engine=True, offload=False)
    lanes = {n: "driver" if g.nodes[n]["driver"] else ("A" if g.nodes[n]["role"] in ("actor", "ref") else "B")
             for n in g}
    secs = {n: 1.0 for n in g}
    t = schedule(g, lanes, secs)
    # values (B) run while ref_logprob then actor_logprob (A, the runtime's call order) run, right
    # after generation; the reward model (B) after the values; and the updates overlap too
    assert t["values"][0] == t["ref_logprob"][0] == 2.0
    assert t["actor_logprob"][0] == 3.0
    assert t["reward"][0] == 3.0
    assert t["critic_update"][0] == t["actor_update"][0]
    colocated = schedule(g, {n: "driver" if g.nodes[n]["driver"] else "A" for n in g}, secs)
    assert makespan(t) < makespan(colocated) == len(g)


def test_negative_duration_is_refused():
    from hybridflow.simulator import HflowError

    with pytest.raises(HflowError):
        schedule(chain_free(["a"]), {"a": "G"}, {"a": -1.0})


@st.composite
def random_dataflows(draw):
    n = draw(st.integers(1, 14))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from((min(a, b), max(a, b)) for a, b in edges if a != b)  # i < j: acyclic
    lane_names = ["G0", "G1", "G2", "driver"]
    lanes = {}
    for i in range(n):
        k = draw(st.integers(1, 2))
        chosen = draw(st.lists(st.sampled_from(lane_names), min_size=k, max_size=k, unique=True))
        lanes[i] = chosen[0] if k == 1 else tuple(chosen)
    secs = {i: draw(st.floats(0.0, 10.0, allow_nan=False)) for i in range(n)}
    return g, lanes, secs


@settings(max_examples=150, deadline=None, derandomize=True)
@given(random_dataflows())
def test_schedule_properties_on_random_dags(case):
    g, lanes, secs = case
    t = schedule(g, lanes, secs)
    order = call_order(g)
    pos = {n: i for i, n in enumerate(order)}
    for n, (s, e) in t.items():
        assert e == pytest.approx(s + secs[n]) and s >= 0
        for p in g.predecessors(n):  # no op starts before its inputs end
            assert s >= t[p][1]
    for a in g:  # ops sharing a lane never overlap and run in call order
        for b in g:
            if pos[a] < pos[b] and set(lanes_tuple(lanes[a])) & set(lanes_tuple(lanes[b])):
                assert t[b][0] >= t[a][1]
    for n, (s, _) in t.items():  # and nothing waits without a reason: as early as allowed
        blockers = [t[p][1] for p in g.predecessors(n)]
        blockers += [t[m][1] for m in order[:pos[n]] if set(lanes_tuple(lanes[m])) & set(lanes_tuple(lanes[n]))]
        assert s == pytest.approx(max(blockers, default=0.0))


# ---- simulate(plan): the whole pipeline with the real cost model ------------------------------
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[3] / "examples" / "plans"


def load(name, **changes):
    import json

    from hybridflow.simulator import Plan

    doc = json.loads((EXAMPLES / f"{name}.json").read_text())
    doc.update(changes)
    return Plan.model_validate(doc).validate_parallel()


def test_simulate_prices_every_op_with_the_cost_model_and_schedules_it():
    from hybridflow.simulator.pricing.cost import CostModel, price_op
    from hybridflow.simulator.schedule.schedule import simulate

    plan = load("ppo-llama2-13b-2x8-split")
    cm = CostModel(plan.cluster)
    tl = simulate(plan, cm)
    assert tl.source == "simulated" and tl.tokens_per_iteration == plan.workload.tokens_per_iteration
    by_op = {e.op: e for e in tl.events}
    for op, role in [("generate", "actor"), ("values", "critic"), ("critic_update", "critic"), ("reward", "reward")]:
        c = price_op(cm, plan, op, role)
        e = by_op[op]
        assert e.role == role and e.seconds == pytest.approx(c.seconds) and e.breakdown == c.breakdown
        assert e.group == plan.roles[role].group
    assert by_op["advantage"].group == "driver"
    assert tl.iteration_seconds() == pytest.approx(tl.meta["makespan"])
    assert tl.tokens_per_second() == pytest.approx(plan.workload.tokens_per_iteration / tl.iteration_seconds())


def test_colocating_everything_serializes_what_a_split_overlaps():
    from hybridflow.simulator import DeviceGroup
    from hybridflow.simulator.schedule.schedule import simulate

    split = load("ppo-llama2-13b-2x8-split")
    one = split.model_copy(deep=True)
    one.groups = [DeviceGroup(name="actor_ref", devices=[d for g in split.groups for d in g.devices])]
    for rp in one.roles.values():
        rp.group = "actor_ref"
    tl_split, tl_one = simulate(split), simulate(one)
    # same ops, same prices on the split's devices … the split overlaps, the single lane adds up
    assert tl_split.iteration_seconds() < sum(e.seconds for e in tl_split.events)
    lane = [e for e in tl_one.events if e.group != "driver"]
    assert all(a.end <= b.start + 1e-9 for a, b in zip(lane, lane[1:], strict=False))


def test_a_slower_cost_model_gives_a_slower_timeline():
    from hybridflow.simulator.pricing.cost import CostModel
    from hybridflow.simulator.pricing.efficiency import EfficiencyParams
    from hybridflow.simulator.schedule.schedule import simulate

    plan = load("ppo-llama2-7b-1x8-colocated")
    fast = simulate(plan, CostModel(plan.cluster))
    slow = simulate(plan, CostModel(plan.cluster, EfficiencyParams(matmul_efficiency=0.3)))
    assert slow.iteration_seconds() > fast.iteration_seconds()


def test_grpo_rule_reward_runs_on_the_driver():
    from hybridflow.simulator.schedule.schedule import simulate

    tl = simulate(load("grpo-llama2-7b-1x8"))
    reward = next(e for e in tl.events if e.op == "reward")
    logprob = next(e for e in tl.events if e.op == "ref_logprob")
    # the runtime issues the log-prob calls (ref first), then scores on the driver: the two overlap
    assert reward.group == "driver"
    assert logprob.start == pytest.approx(reward.start)
    assert {e.op for e in tl.events} >= {"generate", "ref_logprob", "actor_update"}
    assert "values" not in {e.op for e in tl.events}


def test_remax_and_safe_rlhf_plans_simulate():
    from hybridflow.simulator.schedule.schedule import simulate

    roles = load("ppo-llama2-7b-1x8-colocated").model_dump()["roles"]
    remax = load("ppo-llama2-7b-1x8-colocated", algorithm="remax",
                 roles={k: v for k, v in roles.items() if k != "critic"})
    tl = simulate(remax)
    gen = next(e for e in tl.events if e.op == "generate")
    base = next(e for e in tl.events if e.op == "generate_baseline")
    assert gen.start >= base.end and [e.op for e in tl.events].count("reward") == 2  # greedy pass first, as run
    safe = load("ppo-llama2-7b-1x8-colocated", algorithm="safe-rlhf",
                roles={**roles, "cost": {**roles["reward"]}, "cost_critic": {**roles["critic"]}})
    events = simulate(safe).events
    assert [e.op for e in events].count("cost") == 1
    assert sorted(e.role for e in events if e.op in ("values", "critic_update")) == ["cost_critic", "cost_critic",
                                                                                     "critic", "critic"]


def test_offload_adds_host_copies_and_time():
    from hybridflow.simulator.schedule.schedule import simulate

    plan = load("ppo-llama2-7b-1x8-colocated")
    base = simulate(plan)
    off = simulate(plan.model_copy(update={"offload": True}))
    copies = [e for e in off.events if e.op in ("offload", "onload")]
    assert copies and all(e.seconds > 0 for e in copies)
    assert not [e for e in base.events if e.op in ("offload", "onload")]


def test_several_iterations_chain_through_the_weights():
    from hybridflow.simulator.schedule.schedule import simulate

    tl = simulate(load("ppo-llama2-13b-2x8-split"), iterations=3)
    assert tl.iterations() == [0, 1, 2]
    for it in (1, 2):
        upd = next(e for e in tl.events if e.iteration == it - 1 and e.op == "actor_update")
        gen = next(e for e in tl.events if e.iteration == it and e.op == "generate")
        vals = next(e for e in tl.events if e.iteration == it and e.op == "values")
        crit = next(e for e in tl.events if e.iteration == it - 1 and e.op == "critic_update")
        assert gen.start >= upd.end and vals.start >= crit.end
