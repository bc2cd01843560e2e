"""Offload of idle models as a planner choice: exact against brute force, priced as `simulate` prices the
Plan it writes, chosen by the "auto" policy only when nothing fits without it."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_util import assert_search_is_exact, small_cluster, small_model

from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search, search_as_asked
from hybridflow.simulator import ClusterSpec, Workload
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.plan_memory import plan_memory
from hybridflow.simulator.schedule.schedule import simulate
from hybridflow.simulator.vocabulary.hardware import hardware_preset
from hybridflow.simulator.vocabulary.model import model_preset

models = st.builds(lambda layers, width: small_model(layers=layers, hidden=256 * width, heads=4, kv_heads=2,
                                                     ffn=768 * width, vocab=4000),
                   layers=st.sampled_from([2, 4]), width=st.integers(1, 4))


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(actor=models, critic=models, shape=st.sampled_from([(1, 2), (1, 4), (2, 2)]),
       gib=st.sampled_from([0.8, 1.2, 2.0, 6.0]), algo=st.sampled_from(["ppo", "grpo"]),
       r=st.sampled_from([256, 1024]))
def test_offload_search_equals_brute_force_and_simulate(actor, critic, shape, gib, algo, r):
    cluster = small_cluster(*shape, gib=gib)
    wl = Workload(prompts=64, prompt_len=r, response_len=r, micro_batch_size=4,
                  samples_per_prompt=4 if algo == "grpo" else 1)
    over = {"critic": critic} if algo == "ppo" else {"ref": critic}
    req = SearchRequest.for_algorithm(algo, actor, cluster, wl, over, top_k=3)
    assert_search_is_exact(req, CostModel(cluster), offload=True)


def test_moves_are_priced_and_only_colocated_models_move():
    cluster = small_cluster(1, 4, gib=2.0)
    wl = Workload(prompts=64, prompt_len=256, response_len=256, micro_batch_size=4)
    req = SearchRequest.for_algorithm("ppo", small_model(layers=2, hidden=512, heads=4, kv_heads=2, ffn=1536,
                                                         vocab=4000), cluster, wl, top_k=8)
    cm = CostModel(cluster)
    for s in search(req, cm, offload=True).top:
        tl = simulate(scored_to_plan(req, s), cm)
        moved = {e.role for e in tl.events if e.op in ("onload", "offload")}
        shared = {r for members in s.placement if len(members) > 1 for r in members}
        assert moved == shared
        assert all(e.end > e.start for e in tl.events if e.op in ("onload", "offload"))


def _paper_70b(nodes: int, offload: str) -> SearchRequest:
    cluster = ClusterSpec(hardware=hardware_preset("a100-80g"), nodes=nodes, devices_per_node=8)
    return SearchRequest.for_algorithm("ppo", model_preset("llama2-70b"), cluster, Workload(), top_k=3,
                                       offload=offload)


def test_auto_offloads_only_when_nothing_fits_resident():
    # The paper ran PPO with four Llama-2-70B on 32 A100-80G (§8.2): resident, the states alone exceed
    # the devices; moving the idle models to host memory makes it fit.
    _, never = search_as_asked(_paper_70b(4, "never"))
    assert never.best is None
    planner, auto = search_as_asked(_paper_70b(4, "auto"))
    assert auto.best is not None and auto.best.offload and planner.offload
    plan = scored_to_plan(planner.req, auto.best)
    assert plan.offload and all(m.fits for m in plan_memory(plan).values())
    # where resident plans fit, auto keeps them
    planner, big = search_as_asked(_paper_70b(16, "auto"))
    assert big.best is not None and not big.best.offload


def test_the_runtime_refuses_an_offload_plan_in_one_line():
    import pytest

    from hybridflow.runtime.rl.plan_support import check_runnable
    from hybridflow.runtime.rl.run_config import RunConfig
    from hybridflow.simulator.errors import HflowError

    cluster = small_cluster(1, 4, gib=2.0)
    req = SearchRequest.for_algorithm("grpo", small_model(layers=2, hidden=512, heads=4, kv_heads=2, ffn=1536,
                                                          vocab=4000), cluster,
                                      Workload(prompts=64, prompt_len=256, response_len=256, samples_per_prompt=4))
    found = search(req, CostModel(cluster), offload=True)
    colocated = next(s for s in found.top if len(s.placement) == 1)
    with pytest.raises(HflowError, match="offload false, or plan with more devices"):
        check_runnable(scored_to_plan(req, colocated), RunConfig())


def test_cli_plans_offload_when_needed_and_never_refuses_it(tmp_path, capsys):
    import json

    from hybridflow.tools.cli import main

    argv = ["search", "--nodes", "4", "--model", "llama2-70b", "--algo", "ppo", "--top", "1"]
    assert main([*argv, "--offload", "never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "offloading idle models fits it here (--offload auto)" in err[-1]
    out = tmp_path / "plan.json"
    assert main([*argv, "--out", str(out)]) == 0
    assert "no plan fits with every model resident" in capsys.readouterr().out
    assert json.loads(out.read_text())["offload"] is True
