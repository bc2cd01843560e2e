"""Predicted vs measured, one way for `run`, `quickstart` and `replay` (tools/reports/comparison.py): seconds,
a signed error, small ops grouped, one throughput figure, predictions scaled by the machine's speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from hybridflow.simulator.vocabulary.timeline import Event, Timeline, throughput
from hybridflow.tools.cli import main
from hybridflow.tools.reports.comparison import SMALL_OP_SECONDS, Comparison, comparison_table, speed_line

ROOT = Path(__file__).resolve().parents[3]
TOKENS = 1000


def timeline(source: str, per_iteration: list[dict[str, float]]) -> Timeline:
    """Ops run one after another in each iteration, iterations back to back."""
    events, t = [], 0.0
    for it, ops in enumerate(per_iteration, 1 if source == "measured" else 0):
        for op, s in ops.items():
            events.append(Event(op=op, role="actor", group="g", start=t, end=t + s, iteration=it))
            t += s
    return Timeline(source=source, events=events, tokens_per_iteration=TOKENS)


PREDICTED = timeline("simulated", [{"generate": 0.40, "actor_update": 0.50, "advantage": 1e-6, "reward": 2e-4}])
MEASURED = timeline("measured", [{"generate": 3.0, "actor_update": 2.0, "advantage": 0.004, "reward": 0.003},
                                 {"generate": 0.50, "actor_update": 0.40, "advantage": 0.002, "reward": 0.003},
                                 {"generate": 0.52, "actor_update": 0.44, "advantage": 0.003, "reward": 0.001}])


def render(table) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def test_measured_figures_leave_out_the_first_iteration_and_take_the_median():
    c = Comparison.from_timelines(PREDICTED, MEASURED)
    assert c.label == "median of iterations 2–3"
    assert c.measured_iteration == pytest.approx((0.905 + 0.964) / 2)  # the spans of iterations 2 and 3
    assert c.measured_ops["generate"] == pytest.approx(0.51)
    # one throughput: the timeline's, the trainer's per-iteration figure and the table's agree
    assert MEASURED.tokens_per_second() == pytest.approx(throughput(TOKENS, c.measured_iteration))
    assert c.json()["throughput"]["measured"] == pytest.approx(MEASURED.tokens_per_second())


def test_table_shows_seconds_a_signed_error_and_groups_small_ops():
    c = Comparison.from_timelines(PREDICTED, MEASURED)
    rows = {r[0]: r for r in c.rows()}
    grouped = f"2 op(s) under {SMALL_OP_SECONDS * 1e3:g} ms: advantage, reward"
    assert grouped in rows and rows[grouped][3] is False  # no error shown for the noise
    text = render(comparison_table(c))
    assert "error = (predicted − measured) / measured" in text
    gen = next(line for line in text.splitlines() if "generate" in line)
    assert "400.0 ms" in gen and "510.0 ms" in gen and "-22%" in gen  # (0.40 − 0.51) / 0.51
    assert "×" not in text.split("tokens/s")[-1]  # no ratios
    assert "not checked" in speed_line(c)


def test_predictions_scaled_by_the_machine_speed_stand_beside_the_raw_ones():
    c = Comparison.from_timelines(PREDICTED, MEASURED, speed=1.25, speed_note="profile 'cpu-2core'")
    text = render(comparison_table(c))
    gen = next(line for line in text.splitlines() if "generate" in line)
    assert "predicted × 1.25" in text and "500.0 ms" in gen and "-2%" in gen  # 0.5 vs 0.51
    assert "1.25× slower" in speed_line(c)
    assert c.json()["at_speed"]["ops"]["generate"]["predicted"] == pytest.approx(0.5)


def test_replay_shows_the_same_comparison(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    rows = [{"iteration": i, "seconds": s, "op_seconds": {"generate": s / 2, "actor_update": s / 2, "advantage": 1e-3}}
            for i, s in enumerate([5.0, 1.0, 1.2], 1)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = str(ROOT / "examples/plans/tiny-local.json")
    assert main(["replay", "cpu-2core", "--plan", plan, "--metrics", str(metrics), "--speed", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "error = (predicted − measured) / measured" in out and "predicted × 1.50" in out
    assert "median of 2 iteration(s) after the first 1" in out and "1.50× slower" in out
    assert main(["replay", "cpu-2core", "--plan", plan, "--metrics", str(metrics), "--json"]) == 0
    comparison = json.loads(capsys.readouterr().out)["comparison"]
    assert comparison["iteration"]["measured"] == pytest.approx(1.1) and comparison["iterations"] == 2
    assert main(["replay", "cpu-2core", "--plan", plan, "--speed", "2"]) == 2  # --speed needs --metrics
