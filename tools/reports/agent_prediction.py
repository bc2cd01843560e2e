"""`run`'s predicted timeline for a run of conversations (an `agent` section): the plan priced with its
rollout as multi-turn (simulator/agents/planning.py) on the turns, tokens and tool seconds the run's
conversations showed (its `agent/*` metrics, the first iteration left out when there are more), with the
section's tool_workers and overlap. The single-turn price would decode `response_len` tokens once; a
conversation decodes its turns, re-prefills its context per turn and waits on tools."""

from __future__ import annotations

import statistics


def agent_workload_from_metrics(metrics: list[dict], settings, skip_first: bool = True):
    """AgentWorkload of the run's mean figures (None: no conversation metrics); `skip_first`: the first
    iteration left out when there are more."""
    from hybridflow.simulator.agents.planning import AgentWorkload

    rows = [m for m in metrics if "agent/turns_mean" in m]
    rows = rows[1:] if skip_first and len(rows) > 1 else rows
    if not rows:
        return None

    def mean(key: str) -> float:
        return statistics.mean(float(m[key]) for m in rows)

    turns, generated = mean("agent/turns_mean"), mean("response_length")
    appended = generated / max(mean("agent/generated_share"), 1e-9) - generated
    tool_turns = max(turns - 1.0, 1e-9)
    # per-turn token deciles pooled over the iterations (runtime/agents/trainer_rollout.py conversation_stats)
    calls = [max(1, round(v)) for m in rows for v in m.get("agent/call_turn_tokens", {}).values()]
    final = [max(1, round(v)) for m in rows for v in m.get("agent/final_turn_tokens", {}).values()]
    # a call that failed (malformed, an unknown tool) runs nothing: the seconds are the ones that ran
    ran = mean("agent/tool_calls_mean") - mean("agent/tool_errors_mean")
    workload = AgentWorkload.from_means(turns, generated / turns, appended / tool_turns,
                                        mean("agent/tool_seconds_mean") / max(ran, 1e-9),
                                        multi_turn_share=mean("agent/multi_turn_share"),
                                        tool_turn_call_share=ran / tool_turns if turns > 1.0 else 1.0,
                                        tool_workers=settings.tool_workers, overlap=settings.overlap,
                                        driver_seconds_per_row=_driver_seconds(rows),
                                        prompt_tokens=_prompt_tokens(rows))
    # each iteration's own turn shares: a draw prices one observed rollout (whether a second wave of tools comes)
    shares = [{int(k): s for k, s in m["agent/turns_share"].items()} for m in rows if m.get("agent/turns_share")]
    return workload.model_copy(update={"turns": _turns(rows) or workload.turns, "turn_tokens": calls or workload.turn_tokens,
                                       "final_turn_tokens": final or None, "turn_shares": shares or None})


def _driver_seconds(rows: list[dict]) -> float:
    """The runner's work between calls per conversation handled there, the median over the iterations (a
    driver starved by other processes in a few iterations would swing a mean); 0 without the metric."""
    seen = [float(m["agent/driver_seconds_per_row"]) for m in rows if "agent/driver_seconds_per_row" in m]
    return statistics.median(seen) if seen else 0.0


def _prompt_tokens(rows: list[dict]) -> int | None:
    """The prompts' padded width as the chat template rendered them (`agent/prompt_tokens`), the median over
    the iterations; None without the metric (the plan's prompt_len)."""
    seen = [float(m["agent/prompt_tokens"]) for m in rows if "agent/prompt_tokens" in m]
    return max(1, round(statistics.median(seen))) if seen else None


def _turns(rows: list[dict], n: int = 100) -> list[int]:
    """Turns per conversation as `n` values in the iterations' mean shares (`agent/turns_share`); [] without
    them. In lockstep a rollout lasts as long as its longest conversation: the tail matters."""
    shares: dict[int, float] = {}
    for m in rows:
        for k, s in m.get("agent/turns_share", {}).items():
            shares[int(k)] = shares.get(int(k), 0.0) + s / len(rows)
    return [k for k, s in sorted(shares.items()) for _ in range(round(n * s))]


def multi_turn_prediction(plan, profile: str | None, config, metrics: list[dict], agent=None):
    """The predicted Timeline of `plan` with its rollout priced as the run's conversations (`agent`, else
    read from `metrics`; None: nothing to price them with, or the simulator cannot price the plan)."""
    from hybridflow.simulator.agents.planning import agent_cost_model
    from hybridflow.tools.profile_option import plan_with_profile
    from hybridflow.tools.reports.run import predicted_timeline

    agent = agent or agent_workload_from_metrics(metrics, config.agent)
    if agent is None:
        return None
    moved, cm = plan_with_profile(plan, profile)
    return predicted_timeline(moved, agent_cost_model(cm, agent, moved.cluster), kl_in_reward=config.kl_in_reward)
