"""Draw a Timeline — simulated or measured, the same code — as a Chrome trace or a PNG Gantt chart.

Chrome trace: the Trace Event Format's complete events ("ph": "X", microseconds), one thread per
device group, so https://ui.perfetto.dev (or chrome://tracing) shows one lane per group.
Gantt: one row per device group, a bar per op coloured by op name (ops shorter than 0.2 % of the
chart are drawn as a sliver of that width), matplotlib's Agg backend (no display needed; pyplot's
global state is not touched).

An op that holds several groups at once (the weight broadcast to a separate generation group)
names them joined by "+" in `Event.group`; it is drawn on each of them.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic
from hybridflow.simulator.vocabulary.timeline import OPS, Event, Timeline

# One colour per shared op name (tab20 order), so a chart reads the same every time.
_TAB20 = [
    "#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
    "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
]
OP_COLORS = {op: _TAB20[i % len(_TAB20)] for i, op in enumerate(OPS)}


def event_lanes(event: Event) -> list[str]:
    return event.group.split("+")


def lane_order(timeline: Timeline) -> list[str]:
    """Lanes in order of first appearance, the driver last."""
    seen: dict[str, None] = {}
    for e in sorted(timeline.events, key=lambda e: e.start):
        for lane in event_lanes(e):
            seen.setdefault(lane, None)
    lanes = [x for x in seen if x != "driver"]
    return lanes + (["driver"] if "driver" in seen else [])


def _lane_label(timeline: Timeline, lane: str) -> str:
    what = timeline.meta.get("lanes", {}).get(lane)
    return f"{lane} — {what}" if what else lane


# ---- Chrome trace ---------------------------------------------------------------------------
def chrome_trace(timeline: Timeline) -> dict:
    """The Timeline in the Trace Event Format (JSON object form)."""
    lanes = lane_order(timeline)
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    pname = f"hybridflow ({timeline.source})"
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": pname}}]
    for lane in lanes:
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[lane],
                       "args": {"name": _lane_label(timeline, lane)}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid[lane],
                       "args": {"sort_index": tid[lane]}})
    for e in timeline.events:
        args = {"role": e.role, "iteration": e.iteration, "seconds": e.seconds, "bytes": e.bytes,
                "flops": e.flops, **{f"breakdown.{k}": v for k, v in e.breakdown.items()}}
        for lane in event_lanes(e):
            events.append({"name": e.op, "cat": e.role, "ph": "X", "pid": 1, "tid": tid[lane],
                           "ts": e.start * 1e6, "dur": e.seconds * 1e6, "args": args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": timeline.source, "iteration_seconds": timeline.iteration_seconds(),
                      "tokens_per_second": timeline.tokens_per_second(),
                      **{k: v for k, v in timeline.meta.items() if isinstance(v, str | int | float)}},
    }


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike) -> Path:
    return write_atomic(path, json.dumps(chrome_trace(timeline)) + "\n")


# ---- PNG Gantt chart ------------------------------------------------------------------------
def gantt_png(timeline: Timeline, title: str | None = None, dpi: int = 110) -> bytes:
    """A Gantt chart of the Timeline, one row per device group, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not timeline.events:
        raise HflowError("the timeline has no events; nothing to draw")
    lanes = lane_order(timeline)
    row = {lane: i for i, lane in enumerate(lanes)}
    t0 = min(e.start for e in timeline.events)
    t1 = max(e.end for e in timeline.events)
    span = max(t1 - t0, 1e-12)
    fig = Figure(figsize=(13, 1.2 + 0.75 * len(lanes)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    used: dict[str, str] = {}
    for e in timeline.events:
        color = OP_COLORS.get(e.op, "#555555")
        used.setdefault(e.op, color)
        for lane in event_lanes(e):
            y = row[lane]
            width = max(e.seconds, 0.002 * span)  # a sliver at least, so short ops stay visible
            ax.broken_barh([(e.start - t0, width)], (y - 0.38, 0.76), facecolors=color,
                           edgecolors="white", linewidth=0.6)
            if e.seconds > 0.06 * span:  # label only bars wide enough to hold it
                ax.text(e.start - t0 + e.seconds / 2, y, e.op if e.role in e.op or e.role == "driver"
                        else f"{e.op}\n({e.role})", ha="center", va="center", fontsize=7, clip_on=True)
    for it in timeline.iterations()[1:]:  # where each iteration begins
        start = min(e.start for e in timeline.events if e.iteration == it) - t0
        ax.axvline(start, color="#444444", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([_lane_label(timeline, lane) for lane in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.005)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    its = timeline.iteration_seconds()
    head = title or f"{timeline.meta.get('algorithm', 'RLHF')} — {timeline.source} timeline"
    ax.set_title(f"{head}: {its:.3g} s/iteration, {timeline.tokens_per_second():,.0f} tokens/s", fontsize=10)
    ax.legend(handles=[Patch(facecolor=c, label=op) for op, c in used.items()], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def write_gantt_png(timeline: Timeline, path: str | os.PathLike, title: str | None = None) -> Path:
    if Path(path).suffix.lower() != ".png":
        raise HflowError(f"{path}: the timeline picture is a PNG; give a file name ending in .png")
    return write_atomic(path, gantt_png(timeline, title))
