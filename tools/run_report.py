"""Shared by `run` and `quickstart`: executing a Plan with a live progress bar, predicted vs measured."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.plan import Plan
from hybridflow.simulator.timeline import Timeline


def predicted_timeline(plan: Plan, cost_model=None, kl_in_reward: bool | None = None) -> Timeline | None:
    """The simulator's timeline of one iteration of `plan` (None if the simulator cannot price it);
    `cost_model` prices it on a measured profile's hardware (default: the plan's own); `kl_in_reward`
    as the run's resolved settings (whether the actor keeps its old-log-prob pass; None: the
    algorithm's defaults)."""
    from hybridflow.simulator.schedule import simulate

    try:
        return simulate(plan, cost_model, iterations=1, kl_in_reward=kl_in_reward)
    except HflowError:
        return None


def measured_view(timeline: Timeline) -> tuple[float, dict[str, float], str]:
    """Mean iteration seconds and op seconds, leaving out the first iteration (start-up) when there are more."""
    its = timeline.iterations()
    use = its[1:] if len(its) > 1 else its
    if not use:
        return 0.0, {}, "no iterations"
    secs = sum(timeline.iteration_seconds(i) for i in use) / len(use)
    ops: dict[str, float] = {}
    for i in use:
        for op, s in timeline.op_seconds(i).items():
            ops[op] = ops.get(op, 0.0) + s / len(use)
    label = f"mean of iterations {use[0]}–{use[-1]}" if len(use) > 1 else f"iteration {use[0]}"
    return secs, ops, label


def comparison_table(predicted: Timeline | None, measured: Timeline) -> Table:
    from hybridflow.tools.report import fmt_seconds

    secs, ops, label = measured_view(measured)
    pred_ops = predicted.op_seconds() if predicted else {}
    t = Table(title=f"predicted vs measured ({label})", title_justify="left")
    for col in ("op", "predicted", "measured", "measured / predicted"):
        t.add_column(col, justify="left" if col == "op" else "right")

    def row(name, p, m):
        ratio = f"{m / p:.2f}×" if p and m else "—"
        t.add_row(name, fmt_seconds(p) if p is not None else "—", fmt_seconds(m) if m is not None else "—", ratio)

    for op in sorted(set(ops) | set(pred_ops), key=lambda o: -(ops.get(o) or 0.0)):
        row(op, pred_ops.get(op), ops.get(op))
    row("iteration", predicted.iteration_seconds() if predicted else None, secs)
    return t


def run_with_progress(trainer, iterations: int, resume: bool, console, quiet: bool = False) -> list[dict]:
    """trainer.run with a rich progress bar showing the latest reward, KL and tokens/s."""
    from hybridflow.runtime.calls import WorkerCallError, WorkerDiedError

    progress = Progress(TextColumn("[bold]RL[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console, disable=quiet, transient=False)
    with progress:
        task = progress.add_task("starting workers…", total=iterations)

        def on_iteration(m: dict) -> None:
            kl = f" kl {m['kl']:+.4f}" if "kl" in m else ""
            progress.update(task, advance=1, description=f"it {m['iteration']}: reward {m['reward_mean']:.3f}{kl} "
                                                         f"{m['tokens_per_second']:,.0f} tok/s")

        try:
            return trainer.run(iterations, resume=resume, on_iteration=on_iteration)
        except (WorkerDiedError, WorkerCallError) as e:
            raise HflowError(str(e).splitlines()[0]) from None


def export_timeline(timeline: Timeline, trace: str | None, png: str | None, title: str) -> list[str]:
    import json

    from hybridflow.simulator.export import chrome_trace, gantt_png
    from hybridflow.tools.outputs import write_outputs

    outputs: list[tuple[str, str | bytes]] = []
    if trace:
        outputs.append((trace, json.dumps(chrome_trace(timeline)) + "\n"))
    if png:
        outputs.append((png, gantt_png(timeline, title=title)))
    return write_outputs(outputs)


