"""`compare --backends fsdp,megatron`: the best plan of each training-engine choice side by side.

One search per engine alone and the searched mix (which picks per role): their iteration seconds,
tokens/s, each role's engine and layout, and the seconds of every op in each, so the difference an
engine makes shows op by op (Megatron's distributed optimizer moves its dp traffic to the optimizer
step; FSDP gathers per micro-batch, mostly under compute).
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table


def backend_choices(req, cm, mixed) -> dict[str, dict]:
    """{"fsdp": …, "megatron": …, "fsdp,megatron": …}: each choice's best plan as a PLANSUMMARY plus
    "backends" (role → engine) and "ops" (op → seconds), or {"fits": False, "reason"} when none fits.
    `mixed` is the search result for `req` (all its backends), already run."""
    from hybridflow.planner.plans import plan_summary, scored_to_plan
    from hybridflow.planner.search import search
    from hybridflow.simulator.schedule.schedule import simulate

    out: dict[str, dict] = {}
    for choice in [(b,) for b in req.backends] + [tuple(req.backends)]:
        sub = req.model_copy(update={"backends": choice})
        best = mixed.best if choice == tuple(req.backends) else search(sub, cm).best
        name = ",".join(choice)
        if best is None:
            out[name] = {"fits": False, "reason": f"no plan with {name} fits the cluster"}
            continue
        plan = scored_to_plan(sub, best)
        summary = plan_summary(plan, best.seconds)
        summary["backends"] = {role: rp.train.backend for role, rp in plan.roles.items()}
        summary["ops"] = simulate(plan, cm).op_seconds()
        out[name] = summary
    return out


def backends_table(choices: Mapping[str, Mapping]) -> Table:
    from hybridflow.tools.reports.search import plan_parallel_text
    from hybridflow.tools.reports.tables import fmt_seconds

    t = Table(title="best plan per training engine (same cost model)", title_justify="left")
    for col, kw in [("engines", {}), ("placement", {}), ("parallel (pp-tp-dp)", {"overflow": "fold"}),
                    ("iteration", {"justify": "right"}), ("tokens/s", {"justify": "right"})]:
        t.add_column(col, **kw)
    for name, c in choices.items():
        if "ops" not in c:
            t.add_row(name, "[red]does not fit[/]", c.get("reason", ""), "—", "—")
            continue
        engines = " · ".join(f"{r} {b}" for r, b in c["backends"].items())
        t.add_row(name, " | ".join("+".join(g) for g in c["placement"]), f"{plan_parallel_text(c)}\n{engines}",
                  fmt_seconds(c["iteration_seconds"]), f"{c['tokens_per_second']:,.0f}")
    return t


def ops_table(choices: Mapping[str, Mapping]) -> Table:
    """Seconds of each op in each choice's best plan, and each choice's difference from the first."""
    from hybridflow.tools.reports.tables import fmt_seconds

    fitting = {k: c for k, c in choices.items() if "ops" in c}
    names = list(fitting)
    t = Table(title="op seconds in each best plan (summed over roles)", title_justify="left",
              caption=f"Δ = a choice's seconds − {names[0] if names else '—'}'s", caption_justify="left")
    t.add_column("op")
    for n in names:
        t.add_column(n, justify="right")
    for n in names[1:]:
        t.add_column(f"Δ {n}", justify="right")
    ops = dict.fromkeys(op for c in fitting.values() for op in c["ops"])
    for op in ops:
        secs = [fitting[n]["ops"].get(op, 0.0) for n in names]
        t.add_row(op, *(fmt_seconds(s) for s in secs), *(f"{s - secs[0]:+.2f} s" for s in secs[1:]))
    return t
