"""Rich tables of the planner commands (`hflow-plan search`, `compare`): the top plans and the
searched plan against the baselines. Formatting helpers come from tools/reports/tables.py."""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from hybridflow.tools.reports.tables import fmt_seconds


def _layout(cfg: Mapping) -> str:
    backend = f" {cfg['backend']}" if cfg.get("backend", "fsdp") != "fsdp" else ""
    ep = f"-ep{cfg['ep']}" if cfg.get("ep", 1) > 1 else ""  # as ParallelConfig.label writes it
    sp = f"-sp{cfg['sp']}" if cfg.get("sp", 1) > 1 else ""
    return f"{cfg['pp']}-{cfg['tp']}-{cfg['dp']}{ep}{sp}{backend}"


def plan_parallel_text(summary: Mapping) -> str:
    """"actor 8-4-1 (gen 1-4-2) · critic 1-1-32 …" from a PLANSUMMARY (pp-tp-dp)."""
    parts = []
    for role, p in summary["parallel"].items():
        gen = f" (gen {_layout(p['generate'])})" if "generate" in p else ""
        parts.append(f"{role} {_layout(p['train'])}{gen}")
    return " · ".join(parts)


def top_plans_table(summaries: list[Mapping], title: str = "top plans (pp-tp-dp per model)") -> Table:
    """One row per PLANSUMMARY: placement, devices per model, parallel configs, seconds, tokens/s."""
    t = Table(title=title, title_justify="left")
    for col, kw in [("#", {"justify": "right"}), ("placement", {}), ("devices", {}),
                    ("parallel (pp-tp-dp)", {"overflow": "fold"}), ("iteration", {"justify": "right"}),
                    ("tokens/s", {"justify": "right"})]:
        t.add_column(col, **kw)
    for i, s in enumerate(summaries, 1):
        t.add_row(str(i), " | ".join("+".join(g) for g in s["placement"]),
                  " ".join(f"{r}:{n}" for r, n in s["devices"].items()), plan_parallel_text(s),
                  fmt_seconds(s["iteration_seconds"]), f"{s['tokens_per_second']:,.0f}")
    return t


def compare_table(best: Mapping, baselines: Mapping[str, Mapping]) -> Table:
    """The searched plan against each baseline: tokens/s and the speedup of ours over it."""
    t = Table(title="HybridFlow (searched) vs baselines, same cost model", title_justify="left")
    for col, kw in [("system", {}), ("placement", {}), ("parallel (pp-tp-dp)", {"overflow": "fold"}),
                    ("iteration", {"justify": "right"}), ("tokens/s", {"justify": "right"}),
                    ("speedup of hybridflow", {"justify": "right"})]:
        t.add_column(col, **kw)
    ours = best["tokens_per_second"]
    t.add_row("[bold]hybridflow[/]", " | ".join("+".join(g) for g in best["placement"]), plan_parallel_text(best),
              fmt_seconds(best["iteration_seconds"]), f"{ours:,.0f}", "1.00×")
    for name, b in baselines.items():
        if not b.get("fits", True) and "reason" in b:
            t.add_row(name, "[red]does not fit[/]", b["reason"], "—", "—", "—")
            continue
        speed = ours / b["tokens_per_second"] if b["tokens_per_second"] else float("inf")
        t.add_row(name, " | ".join("+".join(g) for g in b["placement"]), plan_parallel_text(b),
                  fmt_seconds(b["iteration_seconds"]), f"{b['tokens_per_second']:,.0f}", f"{speed:.2f}×")
    return t


def breakdown_table(breakdown: Mapping[str, Mapping]) -> Table:
    """Seconds per op of one iteration for each system (a column each), and what each is priced on
    (tools/commands/compare.py)."""
    ops = sorted({op for b in breakdown.values() for op in b["ops"]},
                 key=lambda op: -max(b["ops"].get(op, 0.0) for b in breakdown.values()))
    t = Table(title="where each system's iteration goes (seconds per op, summed over its calls)", title_justify="left",
              caption="\n".join(f"{name}: priced on {b['mechanics']}" for name, b in breakdown.items()),
              caption_justify="left")
    t.add_column("op")
    for name in breakdown:
        t.add_column(name, justify="right")
    for op in ops:
        t.add_row(op, *(fmt_seconds(b["ops"][op]) if op in b["ops"] else "—" for b in breakdown.values()))
    return t


def modes_table(per_mode: Mapping[str, Mapping], chosen: str, max_staleness: int) -> Table:
    """One row per execution mode: its best plan, staleness, devices for rollout vs training, tokens/s and
    the speedup over the synchronous one; the picked mode marked, modes over the limit greyed."""
    t = Table(title=f"best plan per mode (--max-staleness {max_staleness})", title_justify="left")
    for col, kw in [("mode", {}), ("staleness", {"justify": "right"}), ("rollout | training", {"justify": "right"}),
                    ("placement", {}), ("parallel (pp-tp-dp)", {"overflow": "fold"}),
                    ("iteration", {"justify": "right"}), ("tokens/s", {"justify": "right"}),
                    ("× sync", {"justify": "right"})]:
        t.add_column(col, **kw)
    sync = per_mode.get("sync", {}).get("tokens_per_second")
    for mode, s in per_mode.items():
        name = f"[bold]{mode} ←[/]" if mode == chosen else mode if s["within_max_staleness"] else f"[dim]{mode}[/]"
        if not s.get("fits", True):
            t.add_row(name, str(s["staleness"]), "—", "[red]no plan fits[/]", "", "—", "—", "—")
            continue
        devices = f"{s['rollout_devices']} | {s['training_devices']}" if s["rollout_devices"] else \
            f"shared | {s['training_devices']}"
        t.add_row(name, str(s["staleness"]), devices, " | ".join("+".join(g) for g in s["placement"]),
                  plan_parallel_text(s), fmt_seconds(s["iteration_seconds"]), f"{s['tokens_per_second']:,.0f}",
                  f"{s['tokens_per_second'] / sync:.2f}×" if sync else "—")
    return t
