"""`async_mode.partial_rollout_tokens: auto` made a number before a run starts: of the longest response over
2 … k rounds, the budget the simulator prices fastest for the plan as the run will execute it (its rollout
engine and LoRA adapters set), on a measured profile's cost model or the plan's own hardware figures; None
(off) where none beats running without them (simulator/schedule/schedule.py fastest_partial_budget). The
runtime never prices anything, so `run` calls this before `resolve_run`, and a library caller does too:

    config = with_partial_budget(plan, config, profile="cpu-2core")
    Trainer(resolve_run(plan, config)).run(iterations=10)
"""

from __future__ import annotations

from hybridflow.runtime.rl.resolve import with_lora, with_rollout
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.simulator.vocabulary.plan import Plan

SETTING = "async_mode.partial_rollout_tokens auto"


def with_partial_budget(plan: Plan, config: RunConfig, profile: str | None = None) -> RunConfig:
    """`config` with `auto` replaced by the budget priced fastest (or None); any other value as it is. `profile`:
    a measured profile's file or shipped name (default: the plan's own, then its hardware figures)."""
    if config.async_mode.partial_rollout_tokens != "auto":
        return config
    from hybridflow.simulator.schedule.schedule import fastest_partial_budget

    priced, cost_model = with_lora(with_rollout(plan, config), config), None
    if profile or plan.profile:
        from hybridflow.simulator.calibration.fit import plan_on_profile

        priced, cost_model, _ = plan_on_profile(priced, profile or plan.profile)
    budget, _ = fastest_partial_budget(priced, cost_model, name=SETTING)
    return config.model_copy(update={"async_mode": config.async_mode.model_copy(
        update={"partial_rollout_tokens": budget})})
