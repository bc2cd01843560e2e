"""LoRA against full fine-tuning: the same job searched both ways, each on the smallest cluster it fits.

`hflow-plan search --lora RANK` asks for a LoRA job (SearchRequest.lora: every trained role trains
adapters, the actor's base is the reference). `compare_lora` searches it and the full fine-tune of the
same models (a separate reference model where the algorithm uses one) on the request's cluster, and
finds for each the smallest cluster of the same devices that fits it — within one node the fewest
devices, beyond one the fewest whole nodes — with its best plan there.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.planner.diagnose import fits_somewhere, smallest_cluster
from hybridflow.planner.plans import scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.vocabulary.hardware import ClusterSpec
from hybridflow.simulator.vocabulary.plan import Plan


@dataclass
class Variant:
    """One way of training the job: its request, its best plan on the asked cluster (None: does not fit)
    and on the smallest cluster that fits (None: nothing up to diagnose.MAX_NODES)."""

    name: str
    req: SearchRequest
    here: tuple[Plan, float] | None
    smallest: ClusterSpec | None
    smallest_plan: tuple[Plan, float] | None


def full_finetune(req: SearchRequest) -> SearchRequest:
    """The request without LoRA: every model trained whole, and the reference a model of its own (the actor's)."""
    models, paths = dict(req.models), dict(req.paths)
    if "ref" in get_algorithm(req.algorithm).roles:
        models["ref"] = req.models["actor"]
        if "actor" in req.paths:
            paths["ref"] = req.paths["actor"]
    return req.model_copy(update={"lora": None, "models": models, "paths": paths})


def _on(req: SearchRequest, cluster: ClusterSpec) -> SearchRequest:
    return req.model_copy(update={"cluster": cluster})


def smallest_fit(req: SearchRequest) -> ClusterSpec | None:
    """The smallest cluster of the request's devices on which it fits: the fewest devices of one node,
    else the fewest whole nodes."""
    c = req.cluster
    for n in range(1, c.devices_per_node + 1):
        one = ClusterSpec(hardware=c.hardware, nodes=1, devices_per_node=n)
        if fits_somewhere(_on(req, one)):
            return one
    nodes = smallest_cluster(_on(req, ClusterSpec(hardware=c.hardware, nodes=1, devices_per_node=c.devices_per_node)))
    return None if nodes is None else ClusterSpec(hardware=c.hardware, nodes=nodes, devices_per_node=c.devices_per_node)


def _best(req: SearchRequest, cost_model=None) -> tuple[Plan, float] | None:
    from hybridflow.planner.search import search_as_asked

    _, result = search_as_asked(req, cost_model)
    if result.best is None:
        return None
    return scored_to_plan(req, result.best), result.best.seconds


def compare_lora(req: SearchRequest, cost_model=None) -> list[Variant]:
    """[full fine-tune, LoRA]: each searched on the request's cluster and on its smallest cluster. A given
    cost model prices the request's cluster; the smallest clusters are priced with their defaults."""
    if req.lora is None:
        raise ValueError("compare_lora needs a LoRA request (SearchRequest.lora)")
    out = []
    for name, r in (("full fine-tune", full_finetune(req)), (f"LoRA rank {req.lora.rank}", req)):
        here = _best(r, cost_model)
        small = smallest_fit(r)
        small_plan = None
        if small is not None:
            small_plan = here if small == req.cluster else _best(_on(r, small))
        out.append(Variant(name, r, here, small, small_plan))
    return out
