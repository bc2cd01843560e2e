import networkx as nx
import pytest

from hybridflow.simulator import OPS, HflowError
from hybridflow.simulator.algorithms import algorithm_names, get_algorithm
from hybridflow.simulator.schedule.dataflow import (
    add_offload_ops,
    build_dataflow,
    call_order,
    unroll,
)
from hybridflow.simulator.vocabulary.execution import needs_old_logprob_pass
from hybridflow.simulator.vocabulary.workload import Workload


def flow(algo, roles=None, **kw):
    opts = dict(reward_model=True, cost_model=True, hybrid_engine=True, offload=False)
    opts.update(kw)
    return build_dataflow(algo, roles or get_algorithm(algo).roles, **opts)


def ops_of(g):
    return [g.nodes[n]["op"] for n in call_order(g)]


@pytest.mark.parametrize("algo", algorithm_names())
def test_every_dataflow_is_a_dag_of_shared_op_names(algo):
    g = flow(algo)
    assert nx.is_directed_acyclic_graph(g)
    assert set(ops_of(g)) <= set(OPS)
    order = call_order(g)
    assert [g.nodes[n]["order"] for n in order] == sorted(g.nodes[n]["order"] for n in g)  # call order = topo
    # every op feeds (transitively) a model update: nothing computed is thrown away
    assert {g.nodes[n]["op"] for n in g if g.out_degree(n) == 0} <= {"actor_update", "critic_update"}


def test_ppo_shape():
    g = flow("ppo")
    assert list(g.successors("reshard")) == ["generate"]
    assert set(g.successors("generate")) == {"actor_logprob", "ref_logprob", "values", "reward"}
    assert set(g.predecessors("advantage")) == {"actor_logprob", "ref_logprob", "values", "reward"}
    assert set(g.successors("advantage")) == {"critic_update", "actor_update"}
    assert g.nodes["advantage"]["driver"] and g.nodes["advantage"]["role"] == "driver"
    assert {g.nodes[n]["role"] for n in g} == {"actor", "critic", "ref", "reward", "driver"}


@pytest.mark.parametrize("algo", [a for a in algorithm_names() if not get_algorithm(a).critics])
def test_critic_free_algorithms_have_no_critic_ops(algo):
    ops = ops_of(flow(algo))
    assert "values" not in ops and "critic_update" not in ops


def test_remax_greedy_baseline_and_its_reward():
    g = flow("remax")
    assert ops_of(g).count("reward") == 2
    assert g.has_edge("reshard", "generate_baseline")
    assert g.has_edge("generate_baseline", "reward_baseline")
    assert g.has_edge("reward_baseline", "advantage")
    assert g.nodes["generate_baseline"]["op"] == "generate_baseline"


def test_safe_rlhf_adds_cost_and_a_cost_critic_beside_the_reward_critic():
    g = flow("safe-rlhf")
    ops = ops_of(g)
    assert ops.count("cost") == 1 and g.has_edge("cost", "advantage")
    assert g.nodes["values"]["role"] == "critic" and g.nodes["values@cost_critic"]["role"] == "cost_critic"
    assert [g.nodes[n]["role"] for n in call_order(g) if g.nodes[n]["op"] == "critic_update"] == ["critic", "cost_critic"]


def test_dapo_marks_its_resampled_rollout_and_scores():
    g = flow("dapo", roles=["actor", "ref"], reward_model=False)
    assert g.nodes["generate"]["resampled"] and g.nodes["reward"]["resampled"]
    assert not g.nodes["ref_logprob"].get("resampled")  # the log-probs see only the kept, full batch
    assert set(g.predecessors("ref_logprob")) == {"reward"}  # issued once the batch is filled


def test_rule_based_reward_runs_on_the_driver():
    g = flow("grpo", roles=["actor", "ref"], reward_model=False)
    assert g.nodes["reward"]["driver"]
    g = flow("safe-rlhf", roles=["actor", "critic", "cost_critic", "ref", "reward"], cost_model=False)
    assert g.nodes["cost"]["driver"] and not g.nodes["reward"]["driver"]


def test_no_ref_model_no_ref_logprob():
    assert "ref_logprob" not in ops_of(flow("ppo", roles=["actor", "critic", "reward"]))


def test_separate_generation_group_gets_a_broadcast_not_a_reshard():
    g = flow("ppo", hybrid_engine=False)
    assert "reshard" not in g and g.nodes["broadcast"]["broadcast"]
    assert g.nodes["broadcast"]["op"] == "weight_sync" and g.has_edge("broadcast", "generate")


def test_offload_wraps_each_stretch_of_a_model_in_its_group():
    g = flow("ppo", offload=True)  # all four models in one group
    ops = [(g.nodes[n]["op"], g.nodes[n]["role"]) for n in call_order(g)]
    # the actor ends and starts the iteration: it stays on the devices across the boundary
    assert ops[0] == ("reshard", "actor") and ops[-1] == ("actor_update", "actor")
    # every other model's stretch is onload … offload, and a model is offloaded before the next loads
    for role in ("ref", "reward"):
        i = ops.index(("onload", role))
        assert ops[i + 2] == ("offload", role)
    # values and critic_update: two stretches, the reward model runs between them (the runtime
    # issues the log-prob and value calls before scoring)
    assert ops.count(("onload", "critic")) == 2
    assert nx.is_directed_acyclic_graph(g)
    on = [n for n in g if g.nodes[n]["op"] == "onload" and g.nodes[n]["role"] == "ref"][0]
    assert any(g.nodes[p]["op"] == "offload" for p in g.predecessors(on))


def test_offload_only_between_models_that_share_a_group():
    g = flow("ppo", offload=True, placement=[["actor", "ref"], ["critic"], ["reward"]])
    moved = {g.nodes[n]["role"] for n in g if g.nodes[n]["op"] in ("onload", "offload")}
    assert moved == {"actor", "ref"}


def test_add_offload_ops_respects_the_roles_asked():
    g = flow("ppo")
    lanes = {n: ("driver" if g.nodes[n]["driver"] else "g") for n in g}
    add_offload_ops(g, lanes, {"critic"})
    assert {g.nodes[n]["role"] for n in g if g.nodes[n]["op"] in ("onload", "offload")} == {"critic"}
    assert all(n in lanes for n in g)


def test_unroll_chains_iterations_through_the_updated_weights():
    g = flow("ppo")
    lanes = {n: "x" for n in g}
    big, big_lanes = unroll(g, lanes, 3)
    assert len(big) == 3 * len(g) and set(big_lanes) == set(big)
    assert big.has_edge((0, "actor_update"), (1, "generate"))
    assert big.has_edge((1, "critic_update"), (2, "values"))
    assert not big.has_edge((0, "actor_update"), (1, "ref_logprob"))  # the ref model never changes
    assert [n[0] for n in call_order(big)] == sorted(n[0] for n in big)
    with pytest.raises(HflowError):
        unroll(g, lanes, 0)


def test_bad_requests_are_one_line_errors():
    with pytest.raises(HflowError, match="unknown algorithm 'dpo'"):
        flow("dpo", roles=["actor"])
    with pytest.raises(HflowError, match="needs a 'critic'"):
        flow("ppo", roles=["actor", "reward"])
    with pytest.raises(HflowError, match="unknown role"):
        flow("grpo", roles=["actor", "judge"])


def test_one_pass_drops_actor_logprob_unless_kl_is_in_the_reward():
    one, epochs = Workload(ppo_epochs=1, mini_batches=1), Workload(ppo_epochs=2, mini_batches=1)
    assert not needs_old_logprob_pass(one, ["actor"], kl_in_reward=True)  # no ref: no KL
    assert not needs_old_logprob_pass(one, ["actor", "ref"], kl_in_reward=False)
    assert needs_old_logprob_pass(one, ["actor", "ref"], kl_in_reward=True)
    assert needs_old_logprob_pass(epochs, ["actor"], False) and needs_old_logprob_pass(Workload(), ["actor"], False)
    g = build_dataflow("grpo", ["actor", "ref"], reward_model=False, cost_model=False, hybrid_engine=True,
                       old_logprob_pass=False)
    assert "actor_logprob" not in g
    assert set(g.predecessors("advantage")) == {"ref_logprob", "reward"}
    assert set(g.predecessors("actor_update")) == {"advantage"}
