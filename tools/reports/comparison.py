"""Predicted vs measured, shown one way by `run`, `quickstart` and `replay`.

Seconds side by side and the error as a signed per cent, (predicted − measured) / measured: −20 %
means the simulator promised 20 % less time than the run took. Ops that take under
SMALL_OP_SECONDS on both sides are summed into one row: at a few milliseconds the driver's own
jitter is the measurement, and a ratio of two such numbers says nothing. Throughput is the one
figure of simulator/vocabulary/timeline.py (`throughput`). When the run was priced on a profile of this
machine, the machine's speed now against that profile (`hflow-plan profile --check`'s figure,
re-timed cheaply at the start) scales the predictions, shown beside the raw ones: a shared machine
that runs 1.5× slower than when it was profiled makes every prediction 1.5× short.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from hybridflow.simulator.vocabulary.timeline import Timeline, throughput

SMALL_OP_SECONDS = 0.005


def error(predicted: float, measured: float) -> float | None:
    """(predicted − measured) / measured; None when nothing was measured."""
    return (predicted - measured) / measured if measured > 0 else None


def compare(predicted_iteration: float, predicted_ops: dict[str, float], measured_iteration: float,
            measured_ops: dict[str, float]) -> dict:
    """Per op and for the iteration: {"predicted", "measured", "error"} (the error as above)."""
    def row(p, m):
        return {"predicted": p, "measured": m, "error": error(p, m)}

    ops = {op: row(predicted_ops.get(op, 0.0), measured_ops.get(op, 0.0))
           for op in sorted(set(predicted_ops) | set(measured_ops))}
    return {"iteration": row(predicted_iteration, measured_iteration), "ops": ops}


def predict_plan(plan, cost_model) -> tuple[float, dict[str, float]]:
    """(iteration seconds, seconds per op) of a plan, simulated with `cost_model`."""
    from hybridflow.simulator.schedule.schedule import simulate

    tl = simulate(plan, cost_model)
    return tl.iteration_seconds(0), tl.op_seconds(0)


@dataclass(frozen=True)
class Comparison:
    predicted_iteration: float
    predicted_ops: dict[str, float]
    measured_iteration: float
    measured_ops: dict[str, float]
    tokens_per_iteration: int
    label: str  # which measured iterations, e.g. "median of iterations 2–10"
    speed: float | None = None  # this machine now / its profile (> 1: slower now); None: not checked
    speed_note: str = ""  # what the speed was measured against, or why it was not

    @classmethod
    def from_timelines(cls, predicted: Timeline | None, measured: Timeline, speed: float | None = None,
                       speed_note: str = "") -> Comparison:
        its = measured.steady_iterations()
        label = (f"median of iterations {its[0]}–{its[-1]}" if len(its) > 1 else
                 f"iteration {its[0]}" if its else "no iterations")
        return cls(predicted.iteration_seconds() if predicted else 0.0, predicted.op_seconds() if predicted else {},
                   measured.iteration_seconds(), measured.op_seconds(), measured.tokens_per_iteration, label, speed,
                   speed_note)

    def scaled(self, seconds: float) -> float | None:
        return seconds * self.speed if self.speed else None

    def json(self) -> dict:
        out = compare(self.predicted_iteration, self.predicted_ops, self.measured_iteration, self.measured_ops)
        out["throughput"] = {"predicted": throughput(self.tokens_per_iteration, self.predicted_iteration),
                             "measured": throughput(self.tokens_per_iteration, self.measured_iteration)}
        out["measured_over"] = self.label
        if self.speed:
            out["speed_vs_profile"] = self.speed
            out["at_speed"] = compare(self.predicted_iteration * self.speed,
                                      {k: v * self.speed for k, v in self.predicted_ops.items()},
                                      self.measured_iteration, self.measured_ops)
        return out

    def rows(self) -> list[tuple[str, float | None, float | None, bool]]:
        """(op, predicted, measured, whether an error is meaningful) by measured seconds, the small ops
        summed into one row, then the iteration."""
        ops = set(self.predicted_ops) | set(self.measured_ops)
        small = sorted(op for op in ops if max(self.predicted_ops.get(op, 0.0), self.measured_ops.get(op, 0.0))
                       < SMALL_OP_SECONDS)
        big = sorted(ops - set(small), key=lambda o: -self.measured_ops.get(o, 0.0))
        out = [(op, self.predicted_ops.get(op), self.measured_ops.get(op), True) for op in big]
        if small:
            out.append((f"{len(small)} op(s) under {SMALL_OP_SECONDS * 1e3:g} ms: {', '.join(small)}",
                        sum(self.predicted_ops.get(o, 0.0) for o in small),
                        sum(self.measured_ops.get(o, 0.0) for o in small), False))
        out.append(("iteration", self.predicted_iteration or None, self.measured_iteration or None, True))
        return out


def fmt_error(e: float | None) -> str:
    return "—" if e is None else f"{e:+.0%}"


def comparison_table(c: Comparison) -> Table:
    from hybridflow.tools.reports.tables import fmt_seconds

    def sec(s: float | None) -> str:
        return "—" if s is None else fmt_seconds(s)

    t = Table(title=f"predicted vs measured ({c.label})", caption="error = (predicted − measured) / measured",
              title_justify="left", caption_justify="left")
    t.add_column("op")
    cols = ["predicted", "measured", "error"] + ([f"predicted × {c.speed:.2f}", "error at that speed"] if c.speed
                                                  else [])
    for col in cols:
        t.add_column(col, justify="right")
    for op, p, m, comparable in c.rows():
        cells = [sec(p), sec(m), fmt_error(error(p, m)) if comparable and p is not None and m is not None else "—"]
        if c.speed:
            ps = c.scaled(p) if p is not None else None
            cells += [sec(ps), fmt_error(error(ps, m)) if comparable and ps is not None and m is not None else "—"]
        t.add_row(op, *cells)
    tp, tm = (throughput(c.tokens_per_iteration, s) for s in (c.predicted_iteration, c.measured_iteration))
    cells = [f"{tp:,.0f}" if tp else "—", f"{tm:,.0f}", fmt_error(error(tp, tm)) if tp else "—"]
    if c.speed:
        ts = throughput(c.tokens_per_iteration, c.predicted_iteration * c.speed)
        cells += [f"{ts:,.0f}" if ts else "—", fmt_error(error(ts, tm)) if ts else "—"]
    t.add_row("tokens/s", *cells)
    return t


def speed_line(c: Comparison) -> str:
    """The machine's speed now against its profile, in words."""
    if not c.speed:
        return f"machine speed vs profile: not checked{f' ({c.speed_note})' if c.speed_note else ''}"
    how = "slower" if c.speed > 1 else "faster"
    factor = c.speed if c.speed > 1 else 1 / c.speed
    return (f"machine speed now vs {c.speed_note or 'its profile'}: {factor:.2f}× {how} (hflow-plan profile "
            f"--check's figure); the predictions scaled by {c.speed:.2f} are shown beside the raw ones")
