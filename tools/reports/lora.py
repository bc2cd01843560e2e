"""`hflow-plan search --lora RANK`: the LoRA job next to its full fine-tune (planner/lora.py compare_lora),
each on the asked cluster and on the smallest cluster of the same devices that fits it."""

from __future__ import annotations

from rich.table import Table

from hybridflow.planner.plans import plan_summary
from hybridflow.tools.reports.search import plan_parallel_text
from hybridflow.tools.reports.tables import fmt_seconds


def _cluster(c) -> str:
    return f"{c.nodes}x{c.devices_per_node} {c.hardware.name} ({c.num_devices} devices)"


def lora_json(variants) -> list[dict]:
    out = []
    for v in variants:
        here = plan_summary(*v.here) if v.here else None
        small = plan_summary(*v.smallest_plan) if v.smallest_plan else None
        out.append({"name": v.name, "here": here,
                    "smallest_cluster": None if v.smallest is None else {
                        "nodes": v.smallest.nodes, "devices_per_node": v.smallest.devices_per_node,
                        "devices": v.smallest.num_devices, "hardware": v.smallest.hardware.name},
                    "smallest_plan": small})
    return out


def lora_table(variants, cluster) -> Table:
    t = Table(title=f"LoRA against full fine-tuning (pp-tp-dp per model); asked cluster {_cluster(cluster)}",
              title_justify="left")
    for col, kw in [("training", {}), ("on the asked cluster", {"justify": "right"}),
                    ("smallest cluster that fits", {}), ("its best plan", {"overflow": "fold"}),
                    ("iteration", {"justify": "right"}), ("tokens/s", {"justify": "right"})]:
        t.add_column(col, **kw)
    for v in variants:
        here = fmt_seconds(v.here[1]) if v.here else "does not fit"
        if v.smallest_plan is None:
            t.add_row(v.name, here, "none up to the search's limit", "", "", "")
            continue
        s = plan_summary(*v.smallest_plan)
        placement = " | ".join("+".join(g) for g in s["placement"])
        t.add_row(v.name, here, _cluster(v.smallest), f"{placement}: {plan_parallel_text(s)}",
                  fmt_seconds(s["iteration_seconds"]), f"{s['tokens_per_second']:,.0f}")
    return t
