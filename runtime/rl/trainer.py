"""Trainer: runs a Plan's RLHF algorithm on Ray — groups placed and parallelised exactly as written.

    with Trainer(plan, RunConfig(), metrics_path="metrics.jsonl", checkpoint_dir="ckpt") as t:
        for m in t.run(iterations=10):          # one dict of metrics per iteration
            print(m["reward_mean"])
    t.timeline                                  # the measured Timeline (source="measured")

The trainer takes a plan and a run config (resolved here, rl/resolve.py) or a ResolvedRun (what
`hflow-plan run` resolved before torch loaded), and resolves nothing twice.

One WorkerGroup per device group of the plan, hosting the roles the plan puts there (colocated
roles share a process per device). The algorithm's loop (its registry entry, simulator/algorithms/)
calls the ops of runtime/rl/dataflow.py, with the run's settings resolved against the algorithm's
defaults (RunConfig.for_algorithm). Prompts are encoded and responses decoded with the actor
folder's own tokenizer (tasks/model_tokenizer.py). Per iteration the trainer appends one JSON line
of metrics (reward, KL, losses, tokens/s, seconds per op; every `sample_log_every` iterations a few
sampled responses), hands it to its loggers (runtime/rl/loggers.py) and, with a checkpoint dir, saves
the trained models, the optimizer and the driver's state (data order, the algorithm's driver state
such as Safe-RLHF's Lagrange multiplier, the KL coefficient); `latest` is rewritten only after a
checkpoint is complete, so a crash mid-save leaves the previous one intact and resumable. An
iteration that fails (a reward that raises, a NaN score) writes nothing. With an export dir, every
checkpoint is also written as HF folders (export_dir/iter_N/actor, …) and `export_hf()` writes the
current weights (export_dir/actor, export_dir/critic).

`run` is the one iteration loop. After a lost worker or node (or a call past its timeout) it restarts,
at most `cluster.max_restarts` times: the worker groups start again and resume from the last
checkpoint this run completed (from the models' folders when none was complete yet). The run still
ends at the iteration it was asked for and, since a resume is bit-exact, so do the final parameters.
Iterations after the checkpoint run again; their metrics lines are replaced (metrics_file.py), never
doubled, and every attempt's ops share the run's clock, so no iteration's seconds span the restart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import ray
import torch

from hybridflow.runtime.agents.trainer_rollout import conversation_texts, is_conversation_batch
from hybridflow.runtime.algorithms.advantages import get_advantage_estimator
from hybridflow.runtime.algorithms.functional import masked_mean
from hybridflow.runtime.algorithms.losses import get_policy_loss
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.calls import WorkerDiedError, WorkerTimeoutError
from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.controller.resource_pool import init_ray
from hybridflow.runtime.controller.worker_group import WorkerGroup
from hybridflow.runtime.rl.batches import response_length_quantiles
from hybridflow.runtime.rl.checkpoint_lock import CheckpointLock
from hybridflow.runtime.rl.checkpoints import RunCheckpoints, check_checkpoint_dir, latest_name
from hybridflow.runtime.rl.dataflow import Dataflow
from hybridflow.runtime.rl.evaluation import Evaluator, eval_line
from hybridflow.runtime.rl.loggers import MetricsLogger
from hybridflow.runtime.rl.metrics_file import append_metrics
from hybridflow.runtime.rl.preemption import Preemption
from hybridflow.runtime.rl.resolve import ResolvedRun, resolve_run
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.runtime.rl.run_events import RunEvents
from hybridflow.runtime.rl.worker_specs import WorkerSpecs
from hybridflow.runtime.tasks.data import PromptDataset, PromptSampler
from hybridflow.runtime.tasks.reward_pool import ScoringPool
from hybridflow.runtime.tasks.rewards import load_function
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.errors import HflowError, PreemptedError
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import TRAINED_ROLES
from hybridflow.simulator.vocabulary.timeline import Timeline, throughput

RESTARTABLE = (WorkerDiedError, WorkerTimeoutError)  # a lost worker or node, a call past its timeout


class Trainer:
    def __init__(self, run: ResolvedRun | Plan, config: RunConfig | None = None, *,
                 metrics_path: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                 address: str | None = None, loggers: Sequence[MetricsLogger] = (), events: RunEvents | None = None,
                 export_dir: str | Path | None = None):
        if isinstance(run, Plan):
            run = resolve_run(run, config)
        elif config is not None:
            raise HflowError("a ResolvedRun carries its run config; pass the plan and the config instead")
        self.plan, self.config = plan, cfg = run.plan, run.config
        self.events = events or RunEvents()
        # absolute here, on the driver: workers on other nodes run in other folders (docs/cluster.md)
        self.metrics_path = Path(metrics_path).absolute() if metrics_path else None
        self.checkpoint_dir = Location(checkpoint_dir) if checkpoint_dir else None  # a path or a URL
        self.export_dir = Location(export_dir) if export_dir else None
        self.address = address
        self.loggers = list(loggers)  # each iteration's metrics go to them too (opened and closed by the caller)
        self.algo = get_algorithm(plan.algorithm)
        check_checkpoint_dir(plan, self.checkpoint_dir)
        get_advantage_estimator(cfg.advantage.estimator)  # one-line errors before anything starts
        get_policy_loss(cfg.loss.kind)
        self.workers = WorkerSpecs(plan, cfg, self.events)  # rl/worker_specs.py: what each group runs
        self.tok = self.workers.tok
        data = cfg.data
        self.dataset = (PromptDataset.from_file(data.prompts_file) if data.prompts_file
                        else PromptDataset.from_task(data.task, data.dataset_size, cfg.seed))
        if data.chat_template or self.dataset.has_chat():
            self.tok.require_chat_template()
        if data.overlong == "drop":  # the prompts over prompt_len left out (counted up front by `run`'s check)
            limit = plan.workload.prompt_len
            self.dataset = self.dataset.only([i for i, r in enumerate(self.dataset.rows)
                                              if len(self.tok.encode_prompt(r["prompt"], data.chat_template)) <= limit])
        self.sampler = PromptSampler(len(self.dataset), plan.workload.prompts, cfg.seed)
        self.functions = {s: self._function(getattr(plan, f"{s}_function"), s)
                          for s in self.algo.scores if s not in plan.roles}
        self.groups: dict[str, WorkerGroup] = {}
        self.iteration = 0
        self.timeline = Timeline(source="measured", tokens_per_iteration=plan.workload.tokens_per_iteration,
                                 meta={"algorithm": plan.algorithm, "placement": plan.placement(), "mode": plan.mode,
                                       "staleness": plan.staleness})
        self.df: Dataflow | None = None
        self.origin: float | None = None  # the run's clock: set at the first start, kept across restarts
        self.checkpoints = RunCheckpoints(self)
        self.evaluator, self.eval_last = Evaluator.for_trainer(self), None  # held-out prompts (cfg.eval)
        self.eval_history: list[dict] = []  # each evaluation's metrics, with the updates done before it
        self.preemption = Preemption(cfg.cluster.preempt_grace_s)  # SIGTERM: installed once Ray is up
        # with a checkpoint dir, an iteration's metrics line is written once a checkpoint holds it (or the run
        # ends): a run that dies leaves no line a resume would not rerun
        self.unsaved_metrics: list[dict] = []
        self._owns_ray = False
        # last: nothing above may fail with the folder locked (`hflow-plan run` took it already: a no-op then)
        self.lock = CheckpointLock(self.checkpoint_dir) if self.checkpoint_dir else None
        if self.lock and (took_over := self.lock.acquire()):
            self.events.say(took_over)

    def _function(self, ref: str | None, what: str):
        if ref is None:  # Plan validation makes this unreachable for a plan that passed it
            raise HflowError(f"the plan has neither a '{what}' model nor a {what}_function ('module:function')")
        fn = load_function(ref, f"{what} function")  # imported here too: a bad reference is one line now
        scoring = self.config.scoring
        return ScoringPool(ref, f"{what} function '{ref}'", scoring) if scoring.workers or scoring.timeout_s else fn

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.address:
            self.events.phase("ray", f"joining the Ray cluster at {self.address}")
            init_ray(self.address)
            return
        devices = sum(len(g.devices) for g in self.plan.groups)
        cpus = max(os.cpu_count() or 1, devices)  # one logical CPU per virtual device at least
        self.events.phase("ray", f"starting a local Ray cluster ({cpus} logical CPUs)")
        self._owns_ray = True  # shut it down with the trainer
        init_ray(num_cpus=cpus)

    def start(self) -> Trainer:
        if self.groups:
            return self
        self._start_ray()
        self.preemption.install()  # after Ray's own (ray.init's handler exits 15)
        try:
            self.workers.launch(self.groups, self.checkpoint_dir, self.export_dir)
            if self.origin is None:
                self.origin = time.time()
            self.df = Dataflow(self.plan, self.groups, self.config, self.tok, self.functions, self.prompt_batch,
                               origin=self.origin)
        except BaseException:
            self.shutdown()
            raise
        return self

    # ---- one iteration ------------------------------------------------------------------------
    def prompt_batch(self, count: int | None = None) -> Batch:
        """The next `count` prompts (default: the workload's), each repeated samples_per_prompt times."""
        rows = self.sampler.next_indices(count)
        prompts, cols = self.dataset.take(rows)
        ids, mask = self.tok.encode_prompts(prompts, self.config.data.chat_template,
                                            max_len=self.plan.workload.prompt_len, overlong=self.config.data.overlong)
        batch = Batch({"prompt_ids": ids, "prompt_mask": mask, "data_row": torch.tensor(rows)},
                      non_tensors={"prompt": prompts, **cols}, meta={"data_source": self.dataset.source})
        return batch.repeat_interleave(self.plan.workload.samples_per_prompt)

    def samples(self, batch: Batch) -> list[dict]:
        """A few of the iteration's samples (spread over the batch): prompt, response and scores."""
        n, k = len(batch), self.config.logging.sample_log_count
        idx = sorted({i * n // k for i in range(min(k, n))})
        texts = (conversation_texts(batch[idx], self.tok) if is_conversation_batch(batch)  # the tool turns too
                 else self.tok.decode_responses(batch["responses"][idx], batch["response_mask"][idx]))
        out = []
        for i, text in zip(idx, texts, strict=True):
            prompt = batch["prompt"][i]
            row = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "response": text,
                   "reward": batch["reward_scores"][i].item()}
            if "cost_scores" in batch:
                row["cost"] = batch["cost_scores"][i].item()
            out.append(row)
        return out

    def step(self) -> dict:
        """One iteration; `iteration` counts only those that finished (a failing one writes nothing)."""
        self.start()
        df = self.df
        df.start_iteration(self.iteration + 1)
        self.preemption.where = f"during iteration {self.iteration + 1}"
        start = time.time()
        first_event = len(df.events)
        metrics, batch = self.algo.loop(df, self.prompt_batch())
        wall = time.time() - start
        self.iteration = df.iteration
        events = df.events[first_event:]
        self.timeline.events.extend(events)
        seconds = self.timeline.iteration_seconds(self.iteration)  # as simulated (timeline.py)
        # The policy's reward is that of its rollout on fresh prompts, before any filter (dynamic sampling).
        rewards = (df.rollout_scores if df.rollout_scores is not None else batch["reward_scores"]).float()
        mask = batch["response_mask"]
        tokens = int(batch["attention_mask"].sum())  # the tokens really processed: throughput's numerator
        processed = self.timeline.meta.setdefault("tokens_processed", {})  # by iteration (str: JSON keys)
        processed[str(self.iteration)] = tokens
        steady = [processed[str(i)] for i in self.timeline.steady_iterations() if str(i) in processed]
        self.timeline.tokens_per_iteration = round(sum(steady) / len(steady)) if steady else tokens
        ops: dict[str, float] = {}
        for e in events:
            ops[e.op] = ops.get(e.op, 0.0) + e.seconds
        out = {"iteration": self.iteration, "reward_mean": rewards.mean().item(),
               "success_rate": (rewards >= 1.0).float().mean().item(),
               "response_length": mask.sum(-1).float().mean().item(),
               "response_lengths": response_length_quantiles(mask),
               "advantage_mean": masked_mean(batch["advantages"], mask).item(),
               **df.stats, **metrics, "tokens": tokens, "seconds": seconds, "wall_seconds": wall,
               "tokens_per_second": throughput(tokens, seconds), "op_seconds": ops}
        if "cost_scores" in batch:
            out["cost_mean"] = batch["cost_scores"].float().mean().item()
        every = self.config.logging.sample_log_every
        if every and (self.iteration - 1) % every == 0:
            out["samples"] = self.samples(batch)
        if self.evaluator and self.evaluator.due(self.iteration, self.eval_last):  # rl/evaluation.py
            out.update(self.evaluate())
        for logger in self.loggers:
            logger.log(out)
        self.unsaved_metrics.append(out)
        if self.checkpoint_dir and self.iteration % self.config.checkpoint.save_every == 0:
            self.preemption.where = f"while saving the checkpoint of iteration {self.iteration}"
            self.save_checkpoint()
        if not self.checkpoint_dir or self.checkpoints.saved_iteration == self.iteration:
            self.flush_metrics()
        self.preemption.where = f"after iteration {self.iteration}"
        return out

    def evaluate(self) -> dict:
        """The held-out set's metrics now (rl/evaluation.py), said on the console too."""
        m = self.evaluator.run()
        self.events.say(f"after {self.iteration} update(s): {eval_line(m)}")
        self.eval_history = [e for e in self.eval_history if e["iteration"] < self.iteration]  # a rerun's replace
        self.eval_history.append({"iteration": self.iteration, **{k: v for k, v in m.items() if k != "eval_samples"}})
        return m

    def _log_metrics(self, out: dict) -> None:
        if self.metrics_path:
            append_metrics(self.metrics_path, out)
        for logger in self.loggers:
            logger.log(out)

    def run(self, iterations: int, resume: bool = False,
            on_iteration: Callable[[dict], None] | None = None) -> list[dict]:
        """`iterations` more iterations (after the checkpoint with `resume`); restarted after each lost
        worker or node while `cluster.max_restarts` allow. The metrics of every iteration up to the
        target, each once (a rerun's values)."""
        limit = self.config.cluster.max_restarts
        metrics = self.metrics_path
        metrics_size = metrics.stat().st_size if metrics and metrics.is_file() else 0  # what earlier runs wrote
        before = latest_name(self.checkpoint_dir)  # an earlier run's: resumed only if asked to (`resume`)
        done: dict[int, dict] = {}
        target: int | None = None
        restarts = 0
        while True:
            try:
                self.start()
                if resume:
                    self.resume()  # drops the metrics lines of iterations after the checkpoint
                if target is None:
                    target = self.iteration + iterations
                self.eval_last = target
                if self.evaluator and self.iteration == 0 and not done:  # the held-out set before any update
                    self._log_metrics({"iteration": 0, **self.evaluate()})
                done = {i: m for i, m in done.items() if i <= self.iteration}
                self.timeline.events[:] = [e for e in self.timeline.events if e.iteration <= self.iteration]
                while self.iteration < target:
                    if self.preemption.pending:
                        self._stop_preempted()
                    m = self.step()
                    done[m["iteration"]] = m
                    if on_iteration:
                        on_iteration(m)
                self.flush_metrics()  # the run's end: lines past the last checkpoint too
                return [done[i] for i in sorted(done)]
            except BaseException as e:
                if self.preemption.expired and not isinstance(e, PreemptedError):
                    raise self.preemption.abandoned() from e  # the alarm's error, wrapped by what it cut into
                if not isinstance(e, RESTARTABLE) or restarts >= limit:
                    raise
                restarts += 1
                self.stop_workers()
                now = latest_name(self.checkpoint_dir)
                resume = resume or (now is not None and now != before)  # this run's own checkpoint, if it saved one
                if not resume and metrics and metrics.is_file():  # from the start again: this run's lines go
                    with open(metrics, "r+b") as f:
                        f.truncate(metrics_size)
                where = "the last checkpoint" if resume else "the start (no checkpoint was complete)"
                self.events.phase("restart", f"restart {restarts} of {limit} after: {str(e).splitlines()[0]}; "
                                  f"starting the worker groups again, from {where}")

    def _stop_preempted(self) -> None:
        """After SIGTERM, at the end of a step: save this iteration if it is not saved and the grace left
        allows a save as long as the last one took, then end the run (PreemptedError, exit 143)."""
        p, ck = self.preemption, self.checkpoints
        if p.expired:  # the alarm fired inside code that swallowed its error: nothing more is done
            raise p.abandoned()
        if not self.checkpoint_dir:
            kept = "no --checkpoint-dir: nothing is kept"
        elif ck.saved_iteration == self.iteration and self.iteration > 0:
            kept = f"its checkpoint {latest_name(self.checkpoint_dir)} is complete"
        elif self.iteration == 0:
            kept = "nothing to save yet"
        elif p.left_s() <= ck.last_save_s:
            kept = (f"no time left to save within --preempt-grace {p.grace_s:g} (the last save took "
                    f"{ck.last_save_s:.1f} s); the last complete checkpoint is {latest_name(self.checkpoint_dir)}")
        else:
            p.where = f"while saving the checkpoint of iteration {self.iteration}"
            kept = f"saved checkpoint {self.save_checkpoint()}"
            self.flush_metrics()
        p.disarm()
        raise PreemptedError(f"preempted (SIGTERM): stopped after iteration {self.iteration}; {kept}"
                             + ("; continue with --resume" if self.checkpoint_dir and self.iteration else ""))

    def flush_metrics(self) -> None:
        if self.metrics_path:
            for row in self.unsaved_metrics:
                append_metrics(self.metrics_path, row)
        self.unsaved_metrics = []

    # ---- checkpoints (rl/checkpoints.py) ------------------------------------------------------
    def save_checkpoint(self) -> Location:
        return self.checkpoints.save()

    def load_checkpoint(self) -> Location:
        return self.checkpoints.load()

    def resume(self) -> Location:
        path = self.load_checkpoint()
        self.events.phase("resume", f"resumed from checkpoint {path} (after iteration {self.iteration})")
        return path

    def export_hf(self, folder: str | Path | Location | None = None) -> list[Location]:
        """The trained roles' current weights as HF folders: folder/actor (and folder/critic); folder
        (a path or a URL) defaults to the export dir."""
        return self.checkpoints.export_hf(folder)

    def fingerprints(self) -> dict[str, list[str]]:
        """Per trained role, each rank's hash of parameters + optimizer state (resume checks)."""
        return {r: self.groups[r].call(r, "fingerprint") for r in TRAINED_ROLES if r in self.groups}

    # ---- lifetime -----------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """End the worker groups (Ray stays up); the next `start` builds them again, from the models'
        folders, at iteration 0 of the data order unless a checkpoint is loaded then (`run`'s restarts)."""
        self._end_groups()
        self.df, self.iteration = None, 0
        self.checkpoints.saved_iteration = 0
        self.unsaved_metrics = []  # past the last checkpoint: they run again
        self.sampler = PromptSampler(len(self.dataset), self.plan.workload.prompts, self.config.seed)

    def _end_groups(self) -> None:
        if self.df is not None:
            self.df.rollout.close()  # no new conversation rollouts (those in flight end with the groups)
        for group in {id(g): g for g in self.groups.values()}.values():
            group.shutdown()
            group.pool.remove()
        self.groups = {}

    def shutdown(self) -> None:
        self.preemption.uninstall()
        for fn in self.functions.values():
            if isinstance(fn, ScoringPool):
                fn.close()
        self._end_groups()
        if self.lock:
            self.lock.release()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
