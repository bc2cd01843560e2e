"""Trainer: runs a Plan's RLHF algorithm on Ray — groups placed and parallelised exactly as written.

    with Trainer(plan, RunConfig(), metrics_path="metrics.jsonl", checkpoint_dir="ckpt") as t:
        for m in t.run(iterations=10):          # one dict of metrics per iteration
            print(m["reward_mean"])
    t.timeline                                  # the measured Timeline (source="measured")

One WorkerGroup per device group of the plan, hosting the roles the plan puts there (colocated
roles share a process per device). The algorithm's loop (algorithms/loops.py) calls the ops of
runtime/dataflow.py. Per iteration the trainer appends one JSON line of metrics (reward, KL,
losses, tokens/s, seconds per op) and, with a checkpoint dir, saves the trained models, the
optimizer and the driver's state (data order, Lagrange multiplier); `latest` is rewritten only
after a checkpoint is complete, so a crash mid-save leaves the previous one intact and resumable.
With an export dir, every checkpoint is also written as HF folders (export_dir/iter_N/actor, …) and
`export_hf()` writes the current weights (export_dir/actor, export_dir/critic).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic, write_json_atomic
from hybridflow.simulator.plan import Plan
from hybridflow.simulator.timeline import Timeline

from .algorithms.functional import masked_mean
from .algorithms.loops import ALGORITHMS
from .algorithms.losses import LagrangeMultiplier
from .batch import Batch
from .dataflow import Dataflow
from .resource_pool import ResourcePool, init_ray
from .run_config import RunConfig
from .tasks.data import PromptDataset, PromptSampler
from .tasks.rewards import load_function
from .tasks.tokenizer import CharTokenizer
from .tasks.warmup import WarmupConfig, warm_policy
from .worker_group import RoleSpec, WorkerGroup
from .workers.policy import PolicyWorker
from .workers.value import ValueWorker

TRAINED = ("actor", "critic")


class Trainer:
    def __init__(self, plan: Plan, config: RunConfig | None = None, *, metrics_path: str | Path | None = None,
                 checkpoint_dir: str | Path | None = None, address: str | None = None,
                 export_dir: str | Path | None = None):
        self.plan = plan.validate_parallel()
        self.config = config or RunConfig()
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.export_dir = Path(export_dir) if export_dir else None
        self.address = address
        if any(rp.generate_group for rp in plan.roles.values()):
            raise HflowError("the plan puts generation on separate devices (generate_group); the runtime runs the "
                             "actor's rollout on its own devices through the hybrid engine: drop generate_group")
        if plan.reshard == "broadcast":
            raise HflowError("reshard 'broadcast' is for generation on separate devices, which the runtime does not "
                             "run; use hybridflow, hybridflow-v or ds-chat")
        self.tok = CharTokenizer()
        cfg = self.config
        self.dataset = (PromptDataset.from_file(cfg.prompts_file) if cfg.prompts_file
                        else PromptDataset.from_task(cfg.task, cfg.dataset_size, cfg.seed))
        self.sampler = PromptSampler(len(self.dataset), plan.workload.prompts, cfg.seed)
        self.reward_fn = self._function(plan.reward_function, "reward") if "reward" not in plan.roles else None
        self.cost_fn = (self._function(plan.cost_function, "cost")
                        if plan.algorithm == "safe-rlhf" and "cost" not in plan.roles else None)
        self.lagrange = (LagrangeMultiplier(cfg.lagrange_init, cfg.lagrange_lr, cfg.cost_threshold, cfg.lagrange_max)
                         if plan.algorithm == "safe-rlhf" else None)
        if cfg.kl_coef > 0 and "ref" not in plan.roles:
            raise HflowError(f"kl_coef={cfg.kl_coef} needs a 'ref' model in the plan; add one or set kl_coef to 0")
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
        if role in ("critic", "ref") and self.plan.roles["actor"].model == rp.model:
            return self._model_path("actor")
        return str(warm_policy(rp.model, WarmupConfig(task=self.config.task, seed=self.config.seed)))

    def _role_spec(self, role: str) -> RoleSpec:
        cfg, w, rp = self.config, self.plan.workload, self.plan.roles[role]
        common = dict(micro_batch_size=w.micro_batch_size, seed=cfg.seed)
        if role in ("actor", "ref"):
            trainable = role == "actor"
            kw = dict(trainable=trainable, epochs=w.ppo_epochs, mini_batches=w.mini_batches, **common)
            if trainable:
                gen = self.plan.generation_config()
                kw.update(
                    reshard=self.plan.reshard,
                    optim={"lr": cfg.actor_lr, "grad_clip": cfg.grad_clip},
                    generate_parallel=gen.model_dump(),
                    sampling={"max_new_tokens": w.response_len, "temperature": cfg.temperature, "top_p": cfg.top_p,
                              "top_k": cfg.top_k, "eos_token_id": self.tok.eos_id, "pad_token_id": self.tok.pad_id},
                    loss={"policy_loss": cfg.policy_loss, "clip_ratio": cfg.clip_ratio,
                          "clip_ratio_high": cfg.clip_ratio_high, "entropy_coef": cfg.entropy_coef,
                          "kl_coef": cfg.kl_coef if cfg.kl_mode == "loss" else 0.0, "kl_kind": cfg.kl_kind})
            return RoleSpec(PolicyWorker, rp.train, (self._model_path(role),), kw)
        kw = dict(**common)
        if role == "critic":
            kw.update(optim={"lr": cfg.critic_lr, "grad_clip": cfg.grad_clip}, value_clip=cfg.value_clip,
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
        self.df = Dataflow(self.plan, self.groups, self.config, self.tok, self.reward_fn, self.cost_fn, self.lagrange)
        return self

    # ---- one iteration ------------------------------------------------------------------------
    def prompt_batch(self) -> Batch:
        prompts, cols = self.dataset.take(self.sampler.next_indices())
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
        df.iteration, df.stats = self.iteration, {}
        start = time.time()
        first_event = len(df.events)
        metrics, batch = ALGORITHMS[self.plan.algorithm](df, self.prompt_batch())
        seconds = time.time() - start
        events = df.events[first_event:]
        self.timeline.events.extend(events)
        rewards = batch["reward_scores"].float()
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
                "lagrange": self.lagrange.state_dict() if self.lagrange else None,
                "placement": self.plan.placement()}

    def save_checkpoint(self) -> Path:
        if not self.checkpoint_dir:
            raise HflowError("no checkpoint directory; pass checkpoint_dir")
        path = self.checkpoint_dir / f"iter_{self.iteration:06d}"
        for role in TRAINED:
            if role in self.groups:
                self.groups[role].call(role, "save", str(path))
        write_json_atomic(path / "driver.json", self._driver_state())
        if self.export_dir:
            self.export_hf(self.export_dir / path.name)
        write_atomic(self.checkpoint_dir / "latest", path.name + "\n")  # last: the checkpoint is complete
        return path

    def export_hf(self, folder: str | Path | None = None) -> list[Path]:
        """The trained roles' current weights as HF folders: folder/actor (and folder/critic); folder
        defaults to the export dir."""
        folder = Path(folder) if folder is not None else self.export_dir
        if folder is None:
            raise HflowError("no export directory; pass export_dir or a folder")
        roles = [r for r in TRAINED if r in self.groups]
        for role in roles:
            self.groups[role].call(role, "export_hf", str(folder / role))
        return [folder / r for r in roles]

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
        for role in TRAINED:
            if role in self.groups:
                self.groups[role].call(role, "load", str(path))
        self.iteration = state["iteration"]
        self.sampler.load_state_dict(state["sampler"])
        if self.lagrange and state["lagrange"]:
            self.lagrange.load_state_dict(state["lagrange"])
        return path

    def fingerprints(self) -> dict[str, list[str]]:
        """Per trained role, each rank's hash of parameters + optimizer state (resume checks)."""
        return {r: self.groups[r].call(r, "fingerprint") for r in TRAINED if r in self.groups}

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
