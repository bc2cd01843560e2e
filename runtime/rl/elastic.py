"""Run a Trainer through lost workers and nodes: restart its worker groups and resume from the last
complete checkpoint, up to `RunConfig.max_restarts` times.

A lost worker or node (WorkerDiedError) or a call past its timeout (WorkerTimeoutError: a hung
worker) ends the attempt; every worker group is already shut down then. The trainer starts its
groups again (new processes, placed by the same plan) and loads the checkpoint `latest` names, or
starts from the models' folders when none was complete yet. The run still ends at the iteration it
was asked for, and since a resume is bit-exact, so are the final parameters (tests/runtime/
test_cluster.py). Iterations after the checkpoint run again; their metrics lines are replaced
(metrics_file.py), never doubled.

    metrics = run_with_restarts(trainer, iterations=10)     # trainer.config.max_restarts times at most
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.runtime.controller.calls import WorkerDiedError, WorkerTimeoutError
from hybridflow.runtime.rl.checkpoints import latest_name
from hybridflow.runtime.rl.trainer import Trainer

RESTARTABLE = (WorkerDiedError, WorkerTimeoutError)


def run_with_restarts(trainer: Trainer, iterations: int, resume: bool = False,
                      on_iteration: Callable[[dict], None] | None = None) -> list[dict]:
    """`trainer.run(iterations, resume)`, restarted after each restartable fault while restarts are
    left; the metrics of every iteration up to the target, each once (a rerun's values)."""
    limit = trainer.config.max_restarts
    metrics = trainer.metrics_path
    metrics_size = metrics.stat().st_size if metrics and metrics.is_file() else 0  # what earlier runs wrote
    before = latest_name(trainer.checkpoint_dir)  # an earlier run's: resumed only if asked to (`resume`)
    done: dict[int, dict] = {}
    target: int | None = None
    restarts = 0
    while True:
        try:
            trainer.start()
            if resume:
                trainer.resume()  # drops the metrics lines of iterations after the checkpoint
            if target is None:
                target = trainer.iteration + iterations
            done = {i: m for i, m in done.items() if i <= trainer.iteration}
            trainer.timeline.events[:] = [e for e in trainer.timeline.events if e.iteration <= trainer.iteration]
            while trainer.iteration < target:
                m = trainer.step()
                done[m["iteration"]] = m
                if on_iteration:
                    on_iteration(m)
            return [done[i] for i in sorted(done)]
        except RESTARTABLE as e:
            if restarts >= limit:
                raise
            restarts += 1
            trainer.stop_workers()
            now = latest_name(trainer.checkpoint_dir)
            resume = resume or (now is not None and now != before)  # this run's own checkpoint, if it saved one
            if not resume and metrics and metrics.is_file():  # from the start again: this run's lines go
                with open(metrics, "r+b") as f:
                    f.truncate(metrics_size)
            where = "the last checkpoint" if resume else "the start (no checkpoint was complete)"
            trainer.events.phase("restart", f"restart {restarts} of {limit} after: {str(e).splitlines()[0]}; "
                                 f"starting the worker groups again, from {where}")
