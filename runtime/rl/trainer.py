"""Trainer: runs a Plan's RLHF algorithm on Ray — groups placed and parallelised exactly as written.

    with Trainer(plan, RunConfig(), metrics_path="metrics.jsonl", checkpoint_dir="ckpt") as t:
        for m in t.run(iterations=10):          # one dict of metrics per iteration
            print(m["reward_mean"])
    t.timeline                                  # the measured Timeline (source="measured")

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
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import ray
import torch

from hybridflow.runtime.algorithms.advantages import get_advantage_estimator
from hybridflow.runtime.algorithms.functional import masked_mean
from hybridflow.runtime.algorithms.losses import get_policy_loss
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.controller.resource_pool import ResourcePool, init_ray, place_pool
from hybridflow.runtime.controller.storage import model_folder, output_markers
from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup
from hybridflow.runtime.engines.rollout.generation import SamplingParams
from hybridflow.runtime.engines.train.fsdp.engine import OptimConfig
from hybridflow.runtime.rl.async_rollout import AsyncDataflow
from hybridflow.runtime.rl.checkpoints import (
    DRIVER_STATE,
    check_checkpoint_dir,
    latest_name,
    prune_checkpoints,
    publish_latest,
)
from hybridflow.runtime.rl.dataflow import Dataflow
from hybridflow.runtime.rl.disaggregated import ROLLOUT, DisaggregatedDataflow, start_rollout_group
from hybridflow.runtime.rl.loggers import MetricsLogger
from hybridflow.runtime.rl.metrics_file import append_metrics, drop_after
from hybridflow.runtime.rl.plan_support import check_runnable, role_weights
from hybridflow.runtime.rl.run_config import RunConfig, with_rollout
from hybridflow.runtime.rl.run_events import RunEvents
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.data import PromptDataset, PromptSampler
from hybridflow.runtime.tasks.model_tokenizer import load_tokenizer
from hybridflow.runtime.tasks.policy_cache import cached_policy, check_warmup_shape, warmup_cost
from hybridflow.runtime.tasks.rewards import load_function
from hybridflow.runtime.tasks.tokenizer import CharTokenizer, Tokenizer
from hybridflow.runtime.tasks.warmup import warm_policy
from hybridflow.runtime.workers.policy import PolicyWorker
from hybridflow.runtime.workers.value import ValueWorker
from hybridflow.simulator.algorithms import TRAINED_ROLES, get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.timeline import Timeline, throughput


class Trainer:
    def __init__(self, plan: Plan, config: RunConfig | None = None, *, metrics_path: str | Path | None = None,
                 checkpoint_dir: str | Path | None = None, address: str | None = None,
                 loggers: Sequence[MetricsLogger] = (), events: RunEvents | None = None,
                 export_dir: str | Path | None = None):
        self.events = events or RunEvents()
        self.config = config or RunConfig()
        self.plan = plan = with_rollout(plan, self.config).validate_parallel()
        # absolute here, on the driver: workers on other nodes run in other folders (docs/cluster.md)
        self.metrics_path = Path(metrics_path).absolute() if metrics_path else None
        self.checkpoint_dir = Location(checkpoint_dir) if checkpoint_dir else None  # a path or a URL
        self.export_dir = Location(export_dir) if export_dir else None
        self.address = address
        self.loggers = list(loggers)  # each iteration's metrics go to them too (opened and closed by the caller)
        self.algo = get_algorithm(plan.algorithm)
        given = self.config
        check_runnable(plan, given)
        check_checkpoint_dir(plan, self.checkpoint_dir)
        self.config = given.for_algorithm(plan.algorithm, has_ref="ref" in plan.roles)
        get_advantage_estimator(self.config.advantage.estimator)  # one-line errors before anything starts
        get_policy_loss(self.config.loss.kind)
        self.tok = self._tokenizer()
        cfg = self.config
        self.dataset = (PromptDataset.from_file(cfg.prompts_file) if cfg.prompts_file
                        else PromptDataset.from_task(cfg.task, cfg.dataset_size, cfg.seed))
        if cfg.chat_template or self.dataset.has_chat():
            self.tok.require_chat_template()
        self.sampler = PromptSampler(len(self.dataset), plan.workload.prompts, cfg.seed)
        self.functions = {s: self._function(getattr(plan, f"{s}_function"), s)
                          for s in self.algo.scores if s not in plan.roles}
        self.groups: dict[str, WorkerGroup] = {}
        self.iteration = 0
        self.timeline = Timeline(source="measured", tokens_per_iteration=plan.workload.tokens_per_iteration,
                                 meta={"algorithm": plan.algorithm, "placement": plan.placement(), "mode": plan.mode,
                                       "staleness": plan.staleness})
        self.df: Dataflow | None = None
        self._owns_ray = False

    @staticmethod
    def _function(ref: str | None, what: str):
        if ref is None:  # Plan validation makes this unreachable for a plan that passed it
            raise HflowError(f"the plan has neither a '{what}' model nor a {what}_function ('module:function')")
        return load_function(ref, f"{what} function")

    def _tokenizer(self) -> Tokenizer:
        """The actor folder's tokenizer; the character tokenizer for the built-in warmed-up policy, after
        checking that every model the warm-up would build has its vocabulary (before anything starts)."""
        actor = self.plan.roles["actor"]
        for role, rp in self.plan.roles.items():
            if role_weights(self.plan, role, get_task(self.config.task).reward_function) is None:
                check_warmup_shape(rp.model)  # the built-in policy: warmed up here, character vocabulary only
        if actor.path:
            return load_tokenizer(actor.path, model_vocab=ModelSpec.from_hf_config(actor.path).vocab)
        return CharTokenizer()

    # ---- placement ----------------------------------------------------------------------------
    def _model_path(self, role: str) -> str:
        path = role_weights(self.plan, role, get_task(self.config.task).reward_function)
        if path:
            return path
        rp = self.plan.roles[role]
        cfg = self.config.warmup_config()
        if cached_policy(rp.model, cfg) is None:
            self.events.phase("warmup", f"warming up the built-in policy '{rp.model.name}' on task '{cfg.task}', the "
                              f"first time only ({warmup_cost(rp.model, cfg).describe()}; it stops early once "
                              f"{cfg.target_greedy_accuracy:.0%} of held-out prompts come out exact)", total=cfg.max_steps)
        return str(warm_policy(rp.model, cfg, on_step=lambda step, _: self.events.advance(step)))

    def _sampling(self) -> SamplingParams:
        cfg = self.config
        return SamplingParams(max_new_tokens=self.plan.workload.response_len, temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, eos_token_id=self.tok.eos_ids,
                              pad_token_id=self.tok.pad_id)

    def _role_spec(self, role: str) -> RoleSpec:
        cfg, w, rp = self.config, self.plan.workload, self.plan.roles[role]
        common = dict(micro_batch_size=w.micro_batch_size, seed=cfg.seed)
        if role in ("actor", "ref"):
            kw = dict(trainable=role == "actor", epochs=w.ppo_epochs, mini_batches=w.mini_batches,
                      temperature=cfg.temperature, **common)  # log-probs at the sampling temperature
            if role == "actor":
                separate = rp.generate_group is not None  # generation on rollout devices (disaggregated.py)
                kw.update(
                    reshard=self.plan.reshard, rollout=None if separate else rp.rollout, prompt_len=w.prompt_len,
                    optim=OptimConfig(lr=cfg.actor_lr, grad_clip=cfg.grad_clip),
                    generate_parallel=None if separate else self.plan.generation_config(),
                    sampling=self._sampling(), loss=cfg.loss, kl=cfg.kl, norm_length=w.response_len)
            return RoleSpec(PolicyWorker, rp.train, (self._model_path(role),), kw)
        kw = dict(**common)
        if role in TRAINED_ROLES:  # a critic
            kw.update(optim=OptimConfig(lr=cfg.critic_lr, grad_clip=cfg.grad_clip), value_clip=cfg.value_clip,
                      epochs=w.ppo_epochs, mini_batches=w.mini_batches)
        return RoleSpec(ValueWorker, rp.train, (self._model_path(role),), kw)

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
        specs = {role: self._role_spec(role) for role in self.plan.roles}  # warm-up happens here, once
        cfg = self.config
        pools = ResourcePool.from_plan(self.plan, timeout_s=cfg.start_timeout_s)
        try:
            with output_markers({"--checkpoint-dir": self.checkpoint_dir, "--export-hf": self.export_dir}) as shared:
                for g in self.plan.groups:
                    roles = self.plan.roles_in(g.name)
                    if roles:
                        self.events.phase("workers", f"starting {len(g.devices)} worker process(es) for group "
                                          f"'{g.name}' ({', '.join(roles)})")
                        self.events.say(place_pool(pools[g.name]))
                        folders = [model_folder(specs[r].args[0], f"the {r}'s weights folder") for r in roles]
                        group = WorkerGroup(
                            pools[g.name], {r: specs[r] for r in roles}, name=g.name,
                            init_timeout_s=cfg.start_timeout_s, call_timeout=cfg.call_timeout_s,
                            on_role=lambda r: self.events.phase("weights", f"loading {r}'s weights"),
                            on_wait=lambda stage, s, g=g: self.events.say(f"group '{g.name}': {stage}: {s:.0f} s…"),
                            shared_paths=shared + folders)
                        self.groups.update({r: group for r in roles})
                rollout_devices = self.plan.roles["actor"].generate_group
                if rollout_devices:
                    self.events.phase("workers", f"starting {len(self.plan.group(rollout_devices).devices)} "
                                      f"rollout worker process(es) for group '{rollout_devices}'")
                    self.groups[ROLLOUT] = start_rollout_group(self.plan, pools[rollout_devices],
                                                               specs["actor"].args[0], self._sampling(),
                                                               self.config.seed)
            flow = (Dataflow if not rollout_devices else AsyncDataflow if self.plan.mode == "async"
                    else DisaggregatedDataflow)
            self.df = flow(self.plan, self.groups, self.config, self.tok, self.functions, self.prompt_batch)
        except BaseException:
            self.shutdown()
            raise
        return self

    # ---- one iteration ------------------------------------------------------------------------
    def prompt_batch(self, count: int | None = None) -> Batch:
        """The next `count` prompts (default: the workload's), each repeated samples_per_prompt times."""
        rows = self.sampler.next_indices(count)
        prompts, cols = self.dataset.take(rows)
        ids, mask = self.tok.encode_prompts(prompts, self.config.chat_template, max_len=self.plan.workload.prompt_len)
        batch = Batch({"prompt_ids": ids, "prompt_mask": mask, "data_row": torch.tensor(rows)},
                      non_tensors={"prompt": prompts, **cols}, meta={"data_source": self.dataset.source})
        return batch.repeat_interleave(self.plan.workload.samples_per_prompt)

    def samples(self, batch: Batch) -> list[dict]:
        """A few of the iteration's samples (spread over the batch): prompt, response and scores."""
        n, k = len(batch), self.config.sample_log_count
        idx = sorted({i * n // k for i in range(min(k, n))})
        texts = self.tok.decode_responses(batch["responses"][idx], batch["response_mask"][idx])
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
        tokens = int(batch["attention_mask"].sum())
        ops: dict[str, float] = {}
        for e in events:
            ops[e.op] = ops.get(e.op, 0.0) + e.seconds
        out = {"iteration": self.iteration, "reward_mean": rewards.mean().item(),
               "success_rate": (rewards >= 1.0).float().mean().item(),
               "response_length": mask.sum(-1).float().mean().item(),
               "advantage_mean": masked_mean(batch["advantages"], mask).item(),
               **df.stats, **metrics, "tokens": tokens, "seconds": seconds, "wall_seconds": wall,
               "tokens_per_second": throughput(self.plan.workload.tokens_per_iteration, seconds), "op_seconds": ops}
        if "cost_scores" in batch:
            out["cost_mean"] = batch["cost_scores"].float().mean().item()
        every = self.config.sample_log_every
        if every and (self.iteration - 1) % every == 0:
            out["samples"] = self.samples(batch)
        if self.metrics_path:
            append_metrics(self.metrics_path, out)
        for logger in self.loggers:
            logger.log(out)
        if self.checkpoint_dir and self.iteration % self.config.save_every == 0:
            self.save_checkpoint()
        return out

    def run(self, iterations: int, resume: bool = False, on_iteration=None) -> list[dict]:
        self.start()
        if resume:
            self.resume()
        out = []
        for _ in range(iterations):
            m = self.step()
            out.append(m)
            if on_iteration:
                on_iteration(m)
        return out

    # ---- checkpoints --------------------------------------------------------------------------
    def _driver_state(self) -> dict:
        # prompts of a rollout in flight are not trained on yet: a resume draws (and generates) them again,
        # and then jumps over any drawn after them, trained already
        after = self.df.prompts_drawn_after_in_flight()
        sampler = self.sampler.state_dict(rewind=self.df.prompts_in_flight() + after, skip=after)
        return {"iteration": self.iteration, "algorithm": self.plan.algorithm, "sampler": sampler,
                "algorithm_state": self.df.state.state_dict() if self.df.state is not None else None,
                "kl_coef": self.df.kl.state_dict(), "placement": self.plan.placement()}

    def save_checkpoint(self) -> Location:
        if not self.checkpoint_dir:
            raise HflowError("no checkpoint directory; pass checkpoint_dir")
        path = self.checkpoint_dir / f"iter_{self.iteration:06d}"
        for role in TRAINED_ROLES:
            if role in self.groups:
                self.groups[role].call(role, "save", str(path))  # returns once every rank's shards are written
        (path / DRIVER_STATE).write(json.dumps(self._driver_state(), indent=2) + "\n")
        if self.export_dir:
            self.export_hf(self.export_dir / path.name)
        publish_latest(self.checkpoint_dir, path.name)  # last: the checkpoint is complete
        for old in prune_checkpoints(self.checkpoint_dir, self.config.keep_last):
            if self.export_dir:  # a pruned checkpoint's HF export goes with it
                (self.export_dir / old.name).remove()
        return path

    def export_hf(self, folder: str | Path | Location | None = None) -> list[Location]:
        """The trained roles' current weights as HF folders: folder/actor (and folder/critic); folder
        (a path or a URL) defaults to the export dir."""
        folder = Location(str(folder)) if folder is not None else self.export_dir
        if folder is None:
            raise HflowError("no export directory; pass export_dir or a folder")
        roles = [r for r in TRAINED_ROLES if r in self.groups]
        for role in roles:
            self.groups[role].call(role, "export_hf", str(folder / role))
        return [folder / r for r in roles]

    def resume(self) -> Location:
        path = self.load_checkpoint()
        self.events.phase("resume", f"resumed from checkpoint {path} (after iteration {self.iteration})")
        return path

    def load_checkpoint(self) -> Location:
        name = latest_name(self.checkpoint_dir)
        if name is None:
            raise HflowError(f"nothing to resume in {self.checkpoint_dir}: no 'latest' checkpoint; run without "
                             "--resume first")
        path = self.checkpoint_dir / name
        state = json.loads((path / DRIVER_STATE).read_text())
        if state["algorithm"] != self.plan.algorithm or state["placement"] != self.plan.placement():
            raise HflowError(f"{path} was written by a {state['algorithm']} run with placement {state['placement']}; "
                             "resume with the same plan")
        for role in TRAINED_ROLES:
            if role in self.groups:
                self.groups[role].call(role, "load", str(path))
        self.iteration = state["iteration"]
        self.sampler.load_state_dict(state["sampler"])
        if self.df.state is not None and state["algorithm_state"] is not None:
            self.df.state.load_state_dict(state["algorithm_state"])
        self.df.kl.load_state_dict(state["kl_coef"])
        drop_after(self.metrics_path, self.iteration)  # iterations after the checkpoint run again
        return path

    def fingerprints(self) -> dict[str, list[str]]:
        """Per trained role, each rank's hash of parameters + optimizer state (resume checks)."""
        return {r: self.groups[r].call(r, "fingerprint") for r in TRAINED_ROLES if r in self.groups}

    # ---- lifetime -----------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """End the worker groups (Ray stays up); the next `start` builds them again, from the models'
        folders, at iteration 0 of the data order unless a checkpoint is loaded then (runtime/rl/elastic.py)."""
        self._end_groups()
        self.df, self.iteration = None, 0
        self.sampler = PromptSampler(len(self.dataset), self.plan.workload.prompts, self.config.seed)

    def _end_groups(self) -> None:
        for group in {id(g): g for g in self.groups.values()}.values():
            group.shutdown()
            group.pool.remove()
        self.groups = {}

    def shutdown(self) -> None:
        self._end_groups()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
