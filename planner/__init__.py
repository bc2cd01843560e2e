"""hybridflow.planner — Algorithm 1 (HybridFlow §6): placements, allocations and 3D-parallel
configs searched exactly under the simulator's cost model; baseline systems as plans.
Imports only hybridflow.simulator (no torch, no ray)."""

from hybridflow.planner.baselines import BASELINES, Baseline, price_baselines
from hybridflow.planner.plans import plan_summary, scored_to_plan
from hybridflow.planner.request import SearchRequest
from hybridflow.planner.scored import Scored
from hybridflow.planner.search import Planner, SearchResult, search

__all__ = ["BASELINES", "Baseline", "Planner", "Scored", "SearchRequest", "SearchResult", "plan_summary",
           "price_baselines", "scored_to_plan", "search"]
