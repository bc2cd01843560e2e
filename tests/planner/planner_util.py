"""Small specs that make memory bind on purpose: tiny devices, models of a few hundred MB."""

from hybridflow.simulator import ClusterSpec, HardwareSpec, ModelSpec, Workload
from hybridflow.simulator.vocabulary.units import GiB


def small_hardware(gib: float) -> HardwareSpec:
    return HardwareSpec(name=f"toy-{gib}g", peak_flops=100e12, hbm_bandwidth=1.5e12, hbm_bytes=gib * GiB,
                        intra_node_bandwidth=200e9, inter_node_bandwidth=20e9)


def small_model(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=2816, vocab=8000, name="toy") -> ModelSpec:
    return ModelSpec(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab)


def small_moe(layers=2, hidden=512, heads=8, kv_heads=4, ffn=1408, experts=4) -> ModelSpec:
    return ModelSpec(name="toy-moe", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     vocab=4000, family="mixtral", experts=experts, experts_per_token=2)


def small_cluster(nodes=1, per=4, gib=8.0) -> ClusterSpec:
    return ClusterSpec(hardware=small_hardware(gib), nodes=nodes, devices_per_node=per)


SMALL_WORKLOAD = Workload(prompts=64, prompt_len=256, response_len=256, micro_batch_size=4)


def assert_search_is_exact(req, cm, *, offload: bool = False):
    """The search's best equals brute force's under `cm`, and every listed plan fits and simulates to the
    seconds the search gave it. Returns the search's result."""
    import math

    from hybridflow.planner.brute import brute_force
    from hybridflow.planner.plans import scored_to_plan
    from hybridflow.planner.search import search
    from hybridflow.simulator.pricing.plan_memory import plan_memory
    from hybridflow.simulator.schedule.schedule import simulate

    found, ref = search(req, cm, offload=offload), brute_force(req, cm, offload=offload)
    if ref is None:
        assert found.best is None
        return found
    assert found.best is not None, "brute force found a plan the search missed"
    assert math.isclose(found.best.seconds, ref.seconds, rel_tol=1e-9), (found.best, ref)
    for s in found.top:
        plan = scored_to_plan(req, s)
        assert plan.offload == offload and all(m.fits for m in plan_memory(plan).values())
        assert math.isclose(simulate(plan, cm).iteration_seconds(), s.seconds, rel_tol=1e-9)
    return found
