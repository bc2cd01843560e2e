"""Shared by `run` and `quickstart`: a run's phases on the console (the plan's pre-flight checks, joining
a cluster, the warm-up, the iterations), its progress, the speed check and the predicted timeline that
the comparison (tools/reports/comparison.py) sets against the measured one."""

from __future__ import annotations

import time

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.runtime.rl.run_events import Phase, RunEvents
from hybridflow.simulator.errors import HflowError, WorkerLostError
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.timeline import Timeline

LOG_EVERY_STEPS = 25  # into a file (no bar drawn), a warm-up line every so many steps
SPEED_CHECK_MAX_SECONDS = 0.09  # the quick speed check re-times the profile's points up to this long


def predicted_timeline(plan: Plan, cost_model=None, kl_in_reward: bool | None = None,
                       partial_rollout_tokens: int | None = None) -> Timeline | None:
    """The simulator's timeline of one iteration of `plan` (None if the simulator cannot price it);
    `cost_model` prices it on a measured profile's hardware (default: the plan's own); `kl_in_reward`
    as the run's resolved settings (whether the actor keeps its old-log-prob pass; None: the
    algorithm's defaults); `partial_rollout_tokens`: the run's resolved partial-rollout budget (an async plan's
    rollout as its rounds)."""
    from hybridflow.simulator.schedule.schedule import simulate

    try:
        return simulate(plan, cost_model, iterations=1, kl_in_reward=kl_in_reward,
                        partial_rollout_tokens=partial_rollout_tokens)
    except HflowError:
        return None


class ConsoleEvents(RunEvents):
    """A run on the console: one line per phase (seconds since the start in front), a bar for the
    warm-up, a bar for the iterations with the latest reward, KL and throughput (into a file, where
    no bar is drawn: a line per iteration). `quiet` (--json): the phase lines only (the console is
    stderr then), no bars."""

    def __init__(self, console, quiet: bool = False):
        self.console, self.t0 = console, time.monotonic()
        self.progress = Progress(TextColumn("[bold]{task.fields[label]}[/]"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), console=console,
                                 disable=quiet, transient=False)
        self._steps: int | None = None  # the warm-up's bar
        self._steps_since = 0.0
        self._iterations: int | None = None

    def __enter__(self) -> ConsoleEvents:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._end_steps()
        self.progress.stop()

    def say(self, text: str) -> None:
        self.progress.console.print(f"[dim]{time.monotonic() - self.t0:7.1f} s[/]  {text}", highlight=False)

    def phase(self, name: Phase, text: str, total: int | None = None) -> None:
        self._end_steps()
        self.say(text)
        if total:
            self._steps = self.progress.add_task("", total=total, label=name)
            self._steps_since = time.monotonic()
        if self._iterations is not None:
            self.progress.update(self._iterations, description=f"[dim]{name}…[/]")

    def advance(self, done: int) -> None:
        if self._steps is not None:
            total = self.progress.tasks[self._steps].total or 0
            left = (time.monotonic() - self._steps_since) / done * (total - done) if done else 0.0
            self.progress.update(self._steps, completed=done, description=f"at most {left:.0f} s left")
            if done % LOG_EVERY_STEPS == 0 and not self.progress.disable and not self.console.is_terminal:
                self.say(f"step {done} of at most {total}, at most {left:.0f} s left")

    def _end_steps(self) -> None:
        if self._steps is not None:
            done = int(self.progress.tasks[self._steps].completed)
            self.progress.remove_task(self._steps)
            self._steps = None
            self.say(f"done: {done} steps in {time.monotonic() - self._steps_since:.0f} s")

    def iterations(self, total: int) -> None:
        self._iterations = self.progress.add_task("[dim]starting…[/]", total=total, label="RL")

    def iteration(self, m: dict) -> None:
        if self._iterations is None:
            return
        kl = f" kl {m['kl']:+.4f}" if "kl" in m else ""
        text = (f"it {m['iteration']}: reward {m['reward_mean']:.3f}{kl}, {m['seconds']:.2f} s, "
                f"{m['tokens_per_second']:,.0f} tokens/s")
        self.progress.update(self._iterations, advance=1, description=text)
        if not self.progress.disable and not self.console.is_terminal:  # a log file: no live bar, a line each
            self.say(text)
        if m.get("samples") and not self.progress.disable:
            self.progress.console.print(samples_table(m["iteration"], m["samples"]))


def samples_table(iteration: int, samples: list[dict]) -> Table:
    """An iteration's sampled prompts and responses with their scores (prompts and responses cut short)."""
    from hybridflow.runtime.tasks.data import prompt_preview

    t = Table(title=f"samples of iteration {iteration}", title_justify="left")
    scores = [k for k in samples[0] if k not in ("prompt", "response")]
    for col in ("prompt", "response", *scores):
        t.add_column(col, justify="right" if col in scores else "left", overflow="fold")
    for s in samples:
        t.add_row(prompt_preview(s["prompt"]), prompt_preview(s["response"], 80), *(f"{s[k]:.3f}" for k in scores))
    return t


def run_with_progress(trainer, iterations: int, resume: bool, events: ConsoleEvents) -> list[dict]:
    """trainer.run (restarted after a lost worker up to the config's max_restarts), its phases and
    iterations rendered by `events`. A lost worker or node, or a call or start past its timeout, with
    no restart left is a WorkerLostError (exit 3), one line naming the role, rank and node."""
    from hybridflow.runtime.controller.calls import WorkerCallError, WorkerDiedError, WorkerTimeoutError

    events.iterations(iterations)
    try:
        return trainer.run(iterations, resume=resume, on_iteration=events.iteration)
    except (WorkerDiedError, WorkerTimeoutError) as e:
        raise WorkerLostError(str(e).splitlines()[0]) from None
    except WorkerCallError as e:
        raise HflowError(str(e).splitlines()[0]) from None


def quick_speed_check(profile_ref: str, events: ConsoleEvents) -> tuple[float | None, str]:
    """(this machine's speed now / `profile_ref`'s, what it was checked against): the profile's cheap
    one-device points re-timed (a few seconds). (None, why) when the profile is not of this machine."""
    from hybridflow.runtime.measure.hardware_probe import fingerprint
    from hybridflow.runtime.measure.profile_check import check_speed
    from hybridflow.simulator.calibration.profile import resolve_profile

    profile = resolve_profile(profile_ref)
    if not profile.fingerprint.same_machine(fingerprint(profile.fingerprint.devices)):
        return None, f"profile '{profile.name}' was measured on another kind of machine"

    events.say(f"checking this machine's speed against profile '{profile.name}' (a few of its points re-timed)")
    check = check_speed(profile, max_seconds=SPEED_CHECK_MAX_SECONDS)
    return check.index, f"profile '{profile.name}', {len(check.now)} points re-timed"


def check_plan(plan: Plan, cfg: RunConfig, address: str | None, events: ConsoleEvents):
    """The plan against this machine (or, to join a cluster, what can be checked before joining)."""
    from hybridflow.tools.preflight.checks import RunChecks, preflight, this_machine

    checks = preflight(RunChecks(plan, None if address else this_machine(), cfg))
    _say_checks(events, "the plan", checks)
    return checks


def join_cluster(address: str, checks, events: ConsoleEvents) -> None:
    """Join the Ray cluster at `address` and check its resources before any worker starts."""
    import ray

    from hybridflow.runtime.controller.resource_pool import init_ray
    from hybridflow.tools.preflight.checks import MACHINE_CHECKS, preflight, ray_cluster

    events.phase("ray", f"joining the Ray cluster at {address}")
    init_ray(address)
    _say_checks(events, "the cluster", preflight(checks.on(ray_cluster(ray.nodes(), address)), MACHINE_CHECKS))


def _say_checks(events: ConsoleEvents, what: str, checks) -> None:
    events.say(f"checked {what}: {'; '.join(checks.facts)}")
    for w in checks.warnings:
        events.say(f"[yellow]warning:[/] {w}")
