"""hybridflow.planner — Algorithm 1 (HybridFlow §6): placements, allocations and 3D-parallel
configs searched exactly under the simulator's cost model; baseline systems as plans.
Imports only hybridflow.simulator (no torch, no ray)."""

from .baselines import BASELINES, Baseline, price_baselines
from .plans import plan_summary, scored_to_plan
from .request import SearchRequest
from .search import Planner, Scored, SearchResult, search

__all__ = ["BASELINES", "Baseline", "Planner", "Scored", "SearchRequest", "SearchResult", "plan_summary",
           "price_baselines", "scored_to_plan", "search"]
