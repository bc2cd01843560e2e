"""Rich tables the CLI commands share: ops of a Timeline, memory per device, a summary.

Each function builds a `rich.table.Table` (or plain values for --json); printing is the
command's business. Seconds and bytes are formatted the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from hybridflow.simulator.pricing.memory import PARTS
from hybridflow.simulator.vocabulary.timeline import Timeline
from hybridflow.simulator.vocabulary.units import GiB, MiB


def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_bytes(b: float) -> str:
    return f"{b / GiB:.1f} GiB" if b >= 0.1 * GiB else f"{b / MiB:.1f} MiB"


def fmt_breakdown(parts: Mapping[str, float], top: int = 4) -> str:
    """The largest parts first, e.g. "compute 1.20 s · tp_comm 210 ms"."""
    items = sorted(((k, v) for k, v in parts.items() if v > 0), key=lambda kv: -kv[1])
    shown = " · ".join(f"{k} {fmt_seconds(v)}" for k, v in items[:top])
    return shown + (f" · +{len(items) - top} more" if len(items) > top else "")


def ops_table(timeline: Timeline, iteration: int | None = 0, title: str | None = None) -> Table:
    """One row per op of `iteration` (all when None), in start order."""
    lanes = timeline.meta.get("lanes", {})
    t = Table(title=title or f"ops ({timeline.source}, iteration {iteration})", title_justify="left")
    for col, kw in [("op", {}), ("model", {}), ("devices", {}), ("start", {"justify": "right"}),
                    ("seconds", {"justify": "right"}), ("breakdown", {"overflow": "fold"})]:
        t.add_column(col, **kw)
    events = [e for e in timeline.events if iteration is None or e.iteration == iteration]
    t0 = min((e.start for e in events), default=0.0)
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        where = " + ".join(f"{g}: {lanes[g]}" if g in lanes else g for g in e.group.split("+"))
        t.add_row(e.op, e.role, where, fmt_seconds(e.start - t0), fmt_seconds(e.seconds), fmt_breakdown(e.breakdown))
    return t


def _parts(bd) -> dict[str, float]:
    d = bd.model_dump() if hasattr(bd, "model_dump") else dict(bd or {})
    return {k: float(v) for k, v in d.items() if isinstance(v, int | float)}


def memory_rows(memory: Mapping[str, object]) -> dict[str, dict]:
    """Plain values per role from plan_memory's RoleMemory (also the --json form). bytes_per_device
    is the peak of the role's group (colocated models as the runtime holds them); `own` is this
    model's states and its largest transient."""
    out = {}
    for role, m in memory.items():
        row = {"bytes_per_device": float(m.bytes_per_device), "fits": bool(m.fits)}
        for key in ("group", "peak_op", "capacity", "recompute", "decode_batch", "generate_bytes_per_device"):
            if getattr(m, key, None) is not None:
                row[key] = getattr(m, key)
        row["breakdown"] = _parts(getattr(m, "breakdown", None))
        if getattr(m, "own", None) is not None:
            row["own"] = _parts(m.own)
        out[role] = row
    return out


def memory_table(memory: Mapping[str, object], capacity_bytes: float | None = None) -> Table:
    """Per model: its own bytes per device by part, then its group's peak (what decides fits)."""
    rows = memory_rows(memory)
    cap = f" (usable {fmt_bytes(capacity_bytes)})" if capacity_bytes else ""
    t = Table(title=f"memory per device{cap}", title_justify="left")
    t.add_column("model")
    t.add_column("group")
    for p in PARTS:
        t.add_column(p.replace("_", " "), justify="right")
    t.add_column("model total", justify="right")
    t.add_column("group peak (at)", justify="right")
    t.add_column("fits")
    for role, r in rows.items():
        own = r.get("own", r["breakdown"])
        peak = fmt_bytes(r["bytes_per_device"]) + (f" ({r['peak_op']})" if "peak_op" in r else "")
        if r.get("generate_bytes_per_device"):
            peak += f"; generation devices {fmt_bytes(r['generate_bytes_per_device'])}"
        fits = "[green]yes[/]" if r["fits"] else "[bold red]NO[/]"
        if r.get("recompute"):
            fits += " (recompute)"
        t.add_row(role, str(r.get("group", "")), *[fmt_bytes(own.get(p, 0.0)) for p in PARTS],
                  fmt_bytes(sum(own.get(p, 0.0) for p in PARTS)), peak, fits)
    return t


def summary_values(timeline: Timeline) -> dict[str, float]:
    return {
        "iteration_seconds": timeline.iteration_seconds(),
        "tokens_per_iteration": timeline.tokens_per_iteration,
        "tokens_per_second": timeline.tokens_per_second(),
    }


def summary_table(timeline: Timeline, extra: Mapping[str, str] | None = None) -> Table:
    """Iteration seconds and throughput (tokens/s = prompts × samples × (prompt + response) / s)."""
    v = summary_values(timeline)
    t = Table(show_header=False, title="summary", title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    n = len(timeline.steady_iterations())  # a simulated pipeline's warm-up is not one of them
    pipelined = timeline.source == "simulated" and timeline.meta.get("staleness", 0) > 0
    how = " (steady period)" if pipelined else f" (median of {n})" if n > 1 else ""
    t.add_row("iteration time", fmt_seconds(v["iteration_seconds"]) + how)
    t.add_row("tokens / iteration", f"{v['tokens_per_iteration']:,}")
    t.add_row("throughput", f"{v['tokens_per_second']:,.0f} tokens/s")
    for k, val in (extra or {}).items():
        t.add_row(k, val)
    return t


def partial_summary(budget: int | None, seconds: dict) -> dict:
    """A partial-rollout budget and the iteration seconds priced per budget (simulator/schedule/schedule.py
    fastest_partial_budget's, key None: without them) as the JSON outputs and `partial_line` read them."""
    return {"budget": budget, "iteration_seconds": {str(b or "without"): t for b, t in seconds.items()}}


def partial_line(partial: dict) -> str:
    """An async plan's partial-rollout budget ({budget, iteration_seconds?}: None, they do not pay) and, where
    several were priced (simulate --partial-rollout-tokens auto, search --modes), each one's iteration."""
    budget = partial["budget"]
    said = f"{budget} new tokens per response per round" if budget else "none (they do not pay)"
    prices = partial.get("iteration_seconds")
    if prices is None:
        return f"partial rollouts: {said}"
    priced = ", ".join(f"{b} {t:.3f} s" for b, t in prices.items())
    return f"partial rollouts: {said}, the fastest of the iterations priced ({priced})"
