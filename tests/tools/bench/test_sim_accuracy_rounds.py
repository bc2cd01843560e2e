"""The accuracy bench's round order and its pick-vs-fastest figures (no runs: pure helpers)."""

from hybridflow.tools.bench.sim_accuracy import pick_vs_fastest, round_order


def test_rounds_put_every_plan_in_every_slot_and_after_different_plans():
    names = ["a", "b", "c", "d", "pick"]
    orders = [round_order(names, r) for r in range(len(names))]
    assert orders[0] == ["a", "b", "pick", "c", "d"]  # offsets 0, 1, -1, 2, -2
    for order in orders:
        assert sorted(order) == sorted(names)
    for slot in range(len(names)):
        assert {o[slot] for o in orders} == set(names)
    before_pick = {o[o.index("pick") - 1] for o in orders if o.index("pick") > 0}
    assert len(before_pick) >= 2  # (odd n: a Williams square balances predecessors over 2n rounds)
    assert round_order(names, 7) == round_order(names, 2) and round_order([], 3) == []
    four = [round_order(list("abcd"), r) for r in range(4)]  # even n: every ordered pair adjacent once
    pairs = [(o[i], o[i + 1]) for o in four for i in range(3)]
    assert len(pairs) == len(set(pairs)) == 12


def test_pick_vs_fastest_pairs_rounds():
    picked = {"iteration": {"measured": 0.30}, "samples": [0.30, 0.40, 0.29], "spread": 0.01}
    fastest = {"iteration": {"measured": 0.29}, "samples": [0.31, 0.29, 0.29], "spread": 0.01}
    out = pick_vs_fastest(picked, fastest)
    assert abs(out["pick_over_fastest"] - 0.30 / 0.29) < 1e-12
    assert abs(out["paired_ratio"] - 1.0) < 1e-12  # ratios 0.968, 1.379, 1.0: the median
    assert abs(out["gap_in_spreads"] - 0.5) < 1e-9


def test_accuracy_takes_medians_and_leaves_out_driver_ops():
    from hybridflow.tools.bench.sim_accuracy import accuracy

    def row(it, gen, adv):
        return {"iteration": {"error": it}, "ops": {"generate": {"error": gen, "measured": 0.04},
                                                     "advantage": {"error": adv, "measured": 0.002}}}
    out = accuracy([row(-0.1, 0.3, 5.0), row(0.05, -0.1, 5.0), row(0.2, 0.2, 5.0)])
    assert abs(out["median_iteration_error"] - 0.1) < 1e-12
    assert out["op_errors"] == {"generate": 0.2} and out["op_plans"] == {"generate": 3}


def test_scoring_reward_model_scores_and_the_critic_head_does_not(tmp_path):
    import torch

    from hybridflow.runtime.models.decoder import CausalLM
    from hybridflow.runtime.models.hf_format import save_pretrained
    from hybridflow.runtime.workers.common import load_score_model
    from hybridflow.simulator.vocabulary.model import model_preset
    from hybridflow.tools.bench.sim_accuracy import scoring_reward_model

    torch.manual_seed(0)
    policy = save_pretrained(CausalLM(model_preset("tiny").decoder_config()), tmp_path / "policy")
    ids = torch.randint(4, 64, (6, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        scores = load_score_model(scoring_reward_model(policy, tmp_path / "rm"))(input_ids=ids)[:, -1]
        zero = load_score_model(policy)(input_ids=ids)[:, -1]
    assert not zero.any()  # the critic's initialisation: every response scores 0, nothing to learn from
    assert scores.std() > 0.1 and len(set(scores.tolist())) == 6


def test_one_plan_trains_the_actor_and_critic_on_megatron_priced_by_its_own_terms():
    from hybridflow.simulator.calibration.profiled_cost import EngineOverheads, ProfiledCostModel
    from hybridflow.simulator.vocabulary.hardware import ClusterSpec
    from hybridflow.tools.bench.sim_accuracy import candidate_plans
    from hybridflow.tools.reports.comparison import predict_plan

    cluster = ClusterSpec(hardware="a100-80g", nodes=1, devices_per_node=2)
    plans = candidate_plans(cluster.model_dump(), megatron=True)
    assert len(candidate_plans(cluster.model_dump(), megatron=False)) == len(plans) - 1
    meg = plans["colocated tp2, megatron actor+critic"]
    assert {r: rp.train.backend for r, rp in meg.roles.items()} == {"actor": "megatron", "critic": "megatron",
                                                                     "ref": "fsdp", "reward": "fsdp"}
    assert meg.roles["actor"].train.tp == 2 and meg.generation_config().dp == 2
    plain = ProfiledCostModel(cluster)
    fitted = ProfiledCostModel(cluster, overheads=EngineOverheads(megatron_layer_seconds=1e-3))
    (a, a_ops), (b, b_ops) = predict_plan(meg, plain), predict_plan(meg, fitted)
    assert b > a and b_ops["actor_update"] > a_ops["actor_update"] and b_ops["reward"] == a_ops["reward"]
