"""`search --backends fsdp,megatron`: every layout once per training engine, chosen per role; the search
over both is exact, so its best is no slower than the best of either engine alone."""

from planner_util import SMALL_WORKLOAD, small_cluster, small_model

from hybridflow.planner.configs import train_configs
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.search import search

ROLES = ("actor", "critic", "ref", "reward")


def test_train_configs_once_per_backend():
    model = small_model()
    fsdp = train_configs(model, 4, 4)
    both = train_configs(model, 4, 4, backends=("fsdp", "megatron"))
    assert len(both) == 2 * len(fsdp) and {c.backend for c in both} == {"fsdp", "megatron"}
    assert {c.generation_layout() for c in both} == set(fsdp)


def test_search_over_both_backends_is_no_worse_than_either():
    def best(backends):
        req = SearchRequest(algorithm="ppo", models=dict.fromkeys(ROLES, small_model()),
                            cluster=small_cluster(per=4, gib=16.0), workload=SMALL_WORKLOAD, backends=backends)
        return search(req).best

    fsdp, meg, both = best(("fsdp",)), best(("megatron",)), best(("fsdp", "megatron"))
    assert both.seconds <= min(fsdp.seconds, meg.seconds) + 1e-9
    assert all(c.train.backend == "megatron" for _, c in meg.choice)
    assert all(c.generate is None or c.generate.backend == "fsdp" for _, c in meg.choice + both.choice)
