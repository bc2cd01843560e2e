"""Trainer: runs a Plan's RLHF algorithm on Ray — groups placed and parallelised exactly as written.

    with Trainer(plan, RunConfig(), metrics_path="metrics.jsonl", checkpoint_dir="ckpt") as t:
        for m in t.run(iterations=10):          # one dict of metrics per iteration
            print(m["reward_mean"])
    t.timeline                                  # the measured Timeline (source="measured")

One WorkerGroup per device group of the plan, hosting the roles the plan puts there (colocated
roles share a process per device). The algorithm's loop (its registry entry, simulator/algorithms/)
calls the ops of runtime/dataflow.py, with the run's settings resolved against the algorithm's
defaults (RunConfig.for_algorithm). Per iteration the trainer appends one JSON line of metrics
(reward, KL, losses, tokens/s, seconds per op) and, with a checkpoint dir, saves the trained
models, the optimizer and the driver's state (data order, the algorithm's driver state such as
Safe-RLHF's Lagrange multiplier, the KL coefficient); `latest` is rewritten only after a checkpoint
is complete, so a crash mid-save leaves the previous one intact and resumable.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray

from hybridflow.simulator.algorithms import TRAINED_ROLES, get_algorithm
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic, write_json_atomic
from hybridflow.simulator.plan import Plan
from hybridflow.simulator.timeline import Timeline

from .algorithms.advantages import get_advantage_estimator
from .algorithms.functional import masked_mean
from .algorithms.losses import get_policy_loss
from .batch import Batch
from .dataflow import Dataflow
from .engines.generation import SamplingParams
from .engines.training import OptimConfig
from .resource_pool import ResourcePool, init_ray
from .run_config import RunConfig
from .tasks.data import PromptDataset, PromptSampler
from .tasks.rewards import load_function
from .tasks.tokenizer import CharTokenizer
from .tasks.warmup import WarmupConfig, warm_policy
from .worker_group import RoleSpec, WorkerGroup
from .workers.policy import PolicyWorker
from .workers.value import ValueWorker


class Trainer:
    def __init__(self, plan: Plan, config: RunConfig | None = None, *, metrics_path: str | Path | None = None,
                 checkpoint_dir: str | Path | None = None, address: str | None = None):
        self.plan = plan.validate_parallel()
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.address = address
        if any(rp.generate_group for rp in plan.roles.values()):
            raise HflowError("the plan puts generation on separate devices (generate_group); the runtime runs the "
                             "actor's rollout on its own devices through the hybrid engine: drop generate_group")
        if plan.reshard == "broadcast":
            raise HflowError("reshard 'broadcast' is for generation on separate devices, which the runtime does not "
                             "run; use hybridflow, hybridflow-v or ds-chat")
        self.algo = get_algorithm(plan.algorithm)
        given = config or RunConfig()
        if given.kl.coef > 0 and "coef" in given.kl.model_fields_set and "ref" not in plan.roles:
            raise HflowError(f"kl coef {given.kl.coef} needs a 'ref' model in the plan; add one or set kl.coef to 0")
        self.config = given.for_algorithm(plan.algorithm, has_ref="ref" in plan.roles)
        get_advantage_estimator(self.config.advantage.estimator)  # one-line errors before anything starts
        get_policy_loss(self.config.loss.kind)
        self.tok = CharTokenizer()
        cfg = self.config
        self.dataset = (PromptDataset.from_file(cfg.prompts_file) if cfg.prompts_file
                        else PromptDataset.from_task(cfg.task, cfg.dataset_size, cfg.seed))
        self.sampler = PromptSampler(len(self.dataset), plan.workload.prompts, cfg.seed)
        self.functions = {s: self._function(getattr(plan, f"{s}_function"), s)
                          for s in self.algo.scores if s not in plan.roles}
        self.groups: dict[str, WorkerGroup] = {}
        self.iteration = 0
        self.timeline = Timeline(source="measured", tokens_per_iteration=plan.workload.tokens_per_iteration,
                                 meta={"algorithm": plan.algorithm, "placement": plan.placement()})
        self.df: Dataflow | None = None
        self._owns_ray = False

    @staticmethod
    def _function(ref: str | None, what: str):
        if ref is None:  # Plan validation makes this unreachable for a plan that passed it
            raise HflowError(f"the plan has neither a '{what}' model nor a {what}_function ('module:function')")
        return load_function(ref, f"{what} function")

    # ---- placement ----------------------------------------------------------------------------
    def _model_path(self, role: str) -> str:
        rp = self.plan.roles[role]
        if rp.path:
            return rp.path
        if role in ("reward", "cost"):
            raise HflowError(f"role '{role}' has no path: give the HF folder of a {role} model, or drop the role "
                             f"and name a {role}_function ('module:function')")
        if role in ("critic", "cost_critic", "ref") and self.plan.roles["actor"].model == rp.model:
            return self._model_path("actor")
        return str(warm_policy(rp.model, WarmupConfig(task=self.config.task, seed=self.config.seed)))

    def _role_spec(self, role: str) -> RoleSpec:
        cfg, w, rp = self.config, self.plan.workload, self.plan.roles[role]
        common = dict(micro_batch_size=w.micro_batch_size, seed=cfg.seed)
        if role in ("actor", "ref"):
            kw = dict(trainable=role == "actor", epochs=w.ppo_epochs, mini_batches=w.mini_batches,
                      temperature=cfg.temperature, **common)  # log-probs at the sampling temperature
            if role == "actor":
                gen = self.plan.generation_config()
                kw.update(
                    reshard=self.plan.reshard,
                    optim=OptimConfig(lr=cfg.actor_lr, grad_clip=cfg.grad_clip),
                    generate_parallel=gen,
                    sampling=SamplingParams(max_new_tokens=w.response_len, temperature=cfg.temperature, top_p=cfg.top_p,
                                            top_k=cfg.top_k, eos_token_id=self.tok.eos_id, pad_token_id=self.tok.pad_id),
                    loss=cfg.loss, kl=cfg.kl, norm_length=w.response_len)
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
            init_ray(self.address)
            return
        devices = sum(len(g.devices) for g in self.plan.groups)
        self._owns_ray = True  # shut it down with the trainer
        init_ray(num_cpus=max(os.cpu_count() or 1, devices))  # one logical CPU per virtual device at least

    def start(self) -> Trainer:
        if self.groups:
            return self
        self._start_ray()
        specs = {role: self._role_spec(role) for role in self.plan.roles}  # warm-up happens here, once
        pools = ResourcePool.from_plan(self.plan)
        try:
            for g in self.plan.groups:
                roles = self.plan.roles_in(g.name)
                if roles:
                    group = WorkerGroup(pools[g.name], {r: specs[r] for r in roles}, name=g.name)
                    self.groups.update({r: group for r in roles})
        except BaseException:
            self.shutdown()
            raise
        self.df = Dataflow(self.plan, self.groups, self.config, self.tok, self.functions, self.prompt_batch)
        return self

    # ---- one iteration ------------------------------------------------------------------------
    def prompt_batch(self, count: int | None = None) -> Batch:
        """The next `count` prompts (default: the workload's), each repeated samples_per_prompt times."""
        prompts, cols = self.dataset.take(self.sampler.next_indices(count))
        ids, mask = self.tok.encode_prompts(prompts, max_len=None)
        if ids.shape[1] > self.plan.workload.prompt_len:
            raise HflowError(f"a prompt has {ids.shape[1]} tokens but the plan's prompt_len is "
                             f"{self.plan.workload.prompt_len}; raise workload.prompt_len")
        batch = Batch({"prompt_ids": ids, "prompt_mask": mask}, non_tensors={"prompt": prompts, **cols})
        return batch.repeat_interleave(self.plan.workload.samples_per_prompt)

    def step(self) -> dict:
        self.start()
        self.iteration += 1
        df = self.df
        df.start_iteration(self.iteration)
        start = time.time()
        first_event = len(df.events)
        metrics, batch = self.algo.loop(df, self.prompt_batch())
        seconds = time.time() - start
        events = df.events[first_event:]
        self.timeline.events.extend(events)
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
               **df.stats, **metrics, "tokens": tokens, "seconds": seconds,
               "tokens_per_second": tokens / seconds if seconds > 0 else 0.0, "op_seconds": ops}
        if "cost_scores" in batch:
            out["cost_mean"] = batch["cost_scores"].float().mean().item()
        if self.metrics_path:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(out) + "\n")
        if self.checkpoint_dir and self.iteration % self.config.save_every == 0:
            self.save_checkpoint()
        return out

    def run(self, iterations: int, resume: bool = False, on_iteration=None) -> list[dict]:
        self.start()
        if resume:
            self.load_checkpoint()
        out = []
        for _ in range(iterations):
            m = self.step()
            out.append(m)
            if on_iteration:
                on_iteration(m)
        return out

    # ---- checkpoints --------------------------------------------------------------------------
    def _driver_state(self) -> dict:
        return {"iteration": self.iteration, "algorithm": self.plan.algorithm, "sampler": self.sampler.state_dict(),
                "algorithm_state": self.df.state.state_dict() if self.df.state is not None else None,
                "kl_coef": self.df.kl.state_dict(), "placement": self.plan.placement()}

    def save_checkpoint(self) -> Path:
        if not self.checkpoint_dir:
            raise HflowError("no checkpoint directory; pass checkpoint_dir")
        path = self.checkpoint_dir / f"iter_{self.iteration:06d}"
        for role in TRAINED_ROLES:
            if role in self.groups:
                self.groups[role].call(role, "save", str(path))
        write_json_atomic(path / "driver.json", self._driver_state())
        write_atomic(self.checkpoint_dir / "latest", path.name + "\n")  # last: the checkpoint is complete
        return path

    def load_checkpoint(self) -> Path:
        latest = self.checkpoint_dir / "latest" if self.checkpoint_dir else None
        if latest is None or not latest.is_file():
            raise HflowError(f"nothing to resume in {self.checkpoint_dir}: no 'latest' checkpoint; run without "
                             "--resume first")
        path = self.checkpoint_dir / latest.read_text().strip()
        state = json.loads((path / "driver.json").read_text())
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
        return path

    def fingerprints(self) -> dict[str, list[str]]:
        """Per trained role, each rank's hash of parameters + optimizer state (resume checks)."""
        return {r: self.groups[r].call(r, "fingerprint") for r in TRAINED_ROLES if r in self.groups}

    # ---- lifetime -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        for group in {id(g): g for g in self.groups.values()}.values():
            group.shutdown()
            group.pool.remove()
        self.groups = {}
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Trainer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
