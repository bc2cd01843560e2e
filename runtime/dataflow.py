"""Dataflow: the ops an RLHF driver loop calls, each one call on the worker group the plan names.

The algorithms (algorithms/loops.py) are short sequences of these ops. Ops on disjoint groups
overlap: `ref_logprob`, `actor_logprob` and `values` return pending calls that `gather` waits for
together, and `update` steps the critic and the actor at the same time. Every op lands in the
measured Timeline with the worker's own start and end (workers time themselves; see
workers/common.py); rule-based rewards and advantages run in the driver (group "driver").

With one PPO epoch of one mini-batch and no KL in the reward, `actor_logprob` is skipped: the
actor's update takes its own log-probs, detached, as the old ones and reports the KL statistic
(the simulator's dataflow applies the same rule, simulator/dataflow.needs_old_logprob_pass).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybridflow.simulator.dataflow import needs_old_logprob_pass
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.plan import Plan
from hybridflow.simulator.timeline import Event

from .algorithms.advantages import get_advantage_estimator
from .algorithms.functional import masked_mean
from .algorithms.losses import LagrangeMultiplier, kl_in_reward, scores_to_token_rewards
from .batch import Batch
from .calls import CallFuture
from .engines.packing import inverse_order
from .protocols import join, shard
from .run_config import RunConfig
from .tasks.rewards import check_finite_scores, score_responses
from .tasks.tokenizer import Tokenizer
from .worker_group import WorkerGroup

SEQ_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses")


@dataclass
class Pending:
    role: str
    future: CallFuture
    back: torch.Tensor | None = None  # rows of the result in the batch's order (after a balanced call)


def dp_balanced_order(attention_mask: torch.Tensor, dp: int) -> torch.Tensor | None:
    """A row order that gives each of `dp` contiguous shards (DP_COMPUTE's split) the same mix of
    sequence lengths: the rows sorted by length are dealt out snake-wise (verl's balance_batch idea).
    The ranks then hold equal token counts and, with the engine's length buckets, micro-batches of
    equal widths, so they reach FSDP's collectives together. None when there is nothing to balance."""
    n = attention_mask.shape[0]
    if dp < 2 or n % dp:
        return None
    ranked = torch.sort(attention_mask.long().sum(-1), stable=True).indices
    j = torch.arange(n)
    rank = torch.where((j // dp) % 2 == 0, j % dp, dp - 1 - j % dp)  # 0 1 1 0 0 1 … for dp = 2
    return ranked[torch.sort(rank, stable=True).indices]


class Dataflow:
    def __init__(self, plan: Plan, groups: dict[str, WorkerGroup], config: RunConfig, tokenizer: Tokenizer,
                 reward_fn=None, cost_fn=None, lagrange: LagrangeMultiplier | None = None,
                 origin: float | None = None):
        self.plan, self.groups, self.config, self.tok = plan, groups, config, tokenizer
        self.reward_fn, self.cost_fn, self.lagrange = reward_fn, cost_fn, lagrange
        self.origin = time.time() if origin is None else origin
        self.events: list[Event] = []
        self.iteration = 0
        self.stats: dict[str, float] = {}
        self._gen_ranks: list[tuple[int, int]] | None = None
        self.old_logprob_pass = needs_old_logprob_pass(plan.workload, plan.roles, config.kl_in_reward)

    # ---- bookkeeping --------------------------------------------------------------------------
    def has(self, role: str) -> bool:
        return role in self.groups

    def _group_name(self, role: str) -> str:
        return self.plan.roles[role].group

    def _record(self, role: str, group: str, timing: dict) -> None:
        for op, (start, end, *nbytes) in timing.items():
            self.events.append(Event(op=op, role=role, group=group, start=start - self.origin,
                                     end=end - self.origin, iteration=self.iteration, bytes=sum(nbytes)))

    def _take_timing(self, role: str, out: Batch) -> Batch:
        self._record(role, self._group_name(role), out.meta.pop("timing", {}))
        return out

    @contextmanager
    def _on_driver(self, op: str, role: str):
        start = time.time()
        yield
        self._record(role, "driver", {op: (start, time.time())})

    def _call(self, role: str, method: str, batch: Batch) -> Pending:
        return Pending(role, self.groups[role].call_async(role, method, batch))

    def _call_balanced(self, role: str, method: str, batch: Batch) -> Pending:
        """`_call` with the rows spread evenly over the role's dp ranks; results come back in batch order."""
        order = dp_balanced_order(batch["attention_mask"], self.plan.roles[role].train.dp)
        if order is None:
            return self._call(role, method, batch)
        return Pending(role, self.groups[role].call_async(role, method, batch[order]), inverse_order(order))

    # ---- rollout ------------------------------------------------------------------------------
    def generate(self, batch: Batch, greedy: bool = False) -> Batch:
        """Responses for the prompts: one shard per generation replica, read from its tp_g rank 0."""
        group = self.groups["actor"]
        if self._gen_ranks is None:
            self._gen_ranks = group.call("actor", "generation_ranks")  # [(replica, tp_g rank)] by rank
        replicas = 1 + max(rep for rep, _ in self._gen_ranks)
        shards, pad = shard(batch.select("prompt_ids", "prompt_mask", meta=False), replicas)
        outs = group.call("actor", "generate", [shards[rep] for rep, _ in self._gen_ranks],
                          iteration=self.iteration, greedy=greedy)
        readers = sorted((rep, r) for r, (rep, tp) in enumerate(self._gen_ranks) if tp == 0)
        timing: dict[str, list[float]] = {}
        for _, r in readers:  # an op spans from the first replica's start to the last one's end
            for op, (s, e, *nbytes) in outs[r].meta.pop("timing", {}).items():
                old = timing.get(op, [s, e, 0.0])
                timing[op] = [min(old[0], s), max(old[1], e), old[2] + sum(nbytes)]
        self._record("actor", self._group_name("actor"), timing)
        return batch.union(join([outs[r] for _, r in readers], pad))

    def responses_text(self, batch: Batch) -> list[str]:
        return self.tok.decode_responses(batch["responses"], batch["response_mask"])

    # ---- scores -------------------------------------------------------------------------------
    @staticmethod
    def _origin(batch: Batch) -> dict:
        """The data rows and source of the samples, for errors that name them (see Trainer.prompt_batch)."""
        rows = batch["data_row"].tolist() if "data_row" in batch else None
        return {"rows": rows, "source": batch.meta.get("data_source", "")}

    def _rule_scores(self, batch: Batch, fn, role: str) -> torch.Tensor:
        with self._on_driver(role, role):
            prompts = list(batch["prompt"])
            fields = {k: list(v) for k, v in batch.non_tensors.items() if k != "prompt"}
            ref = self.plan.reward_function if role == "reward" else self.plan.cost_function
            return score_responses(fn, prompts, self.responses_text(batch), fields, name=f"{role} function '{ref}'",
                                   **self._origin(batch))

    def score(self, batch: Batch) -> Batch:
        """`reward_scores` (and `cost_scores` for Safe-RLHF): from a score model or a rule-based function;
        a score that is not a finite number ends the run with a one-line error."""
        models = [r for r in ("reward", "cost") if self.has(r)]
        pending = [self._call(r, "compute_scores", batch.select(*SEQ_FIELDS, meta=False)) for r in models]
        if not self.has("reward"):
            batch["reward_scores"] = self._rule_scores(batch, self.reward_fn, "reward")
        if self.plan.algorithm == "safe-rlhf" and not self.has("cost"):
            batch["cost_scores"] = self._rule_scores(batch, self.cost_fn, "cost")
        batch = self.gather(batch, *pending)
        for r in models:
            check_finite_scores(batch[f"{r}_scores"], f"{r} model {self.plan.roles[r].path}", list(batch["prompt"]),
                                **self._origin(batch))
        return batch

    # ---- log-probs and values -----------------------------------------------------------------
    def ref_logprob(self, batch: Batch) -> Pending | None:
        if not self.has("ref"):
            return None
        return self._call_balanced("ref", "compute_log_prob", batch.select(*SEQ_FIELDS, meta=False))

    def actor_logprob(self, batch: Batch) -> Pending | None:
        """The old log-probs, unless the update's own serve (one epoch of one mini-batch, no KL in the reward)."""
        if not self.old_logprob_pass:
            return None
        return self._call_balanced("actor", "compute_log_prob", batch.select(*SEQ_FIELDS, meta=False))

    def values(self, batch: Batch) -> Pending | None:
        if not self.has("critic"):
            return None
        return self._call_balanced("critic", "compute_values", batch.select(*SEQ_FIELDS, meta=False))

    def gather(self, batch: Batch, *pending: Pending | None) -> Batch:
        for p in pending:
            if p is not None:
                out = self._take_timing(p.role, p.future.get())
                batch = batch.union(out if p.back is None else out[p.back])
        return batch

    # ---- advantages ---------------------------------------------------------------------------
    def advantage(self, batch: Batch, estimator: str, baseline: torch.Tensor | None = None) -> Batch:
        cfg, w = self.config, self.plan.workload
        with self._on_driver("advantage", "driver"):
            mask = batch["response_mask"]
            scores = batch["reward_scores"].float()
            if self.plan.algorithm == "safe-rlhf":  # PPO-Lagrangian: the critic learns (r − λc)/(1 + λ)
                lam = self.lagrange.value
                scores = (scores - lam * batch["cost_scores"].float()) / (1.0 + lam)
            if "ref_log_probs" in batch and "old_log_probs" in batch:  # else the update reports it
                self.stats["kl"] = masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask).item()
            if cfg.kl_mode == "reward" and cfg.kl_coef > 0 and "ref_log_probs" in batch:
                rewards, _ = kl_in_reward(scores, batch["old_log_probs"], batch["ref_log_probs"], mask,
                                          cfg.kl_coef, cfg.kl_kind)
            else:
                rewards = scores_to_token_rewards(scores, mask)
            adv, ret = get_advantage_estimator(estimator)(
                rewards, mask, values=batch["values"] if "values" in batch else None,
                group_size=w.samples_per_prompt, baseline=baseline, gamma=cfg.gamma, lam=cfg.lam)
            batch["advantages"], batch["returns"] = adv, ret
        return batch

    # ---- updates ------------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """Critic and actor steps, concurrently when they live on disjoint groups."""
        fields = [*SEQ_FIELDS, "response_mask", "advantages"]
        calls = []
        if self.has("critic"):
            calls.append(self._call_balanced("critic", "update", batch.select(*fields, "values", "returns", meta=False)))
        extra = ["old_log_probs"] if "old_log_probs" in batch else []
        if "ref_log_probs" in batch and (self.config.kl_mode == "loss" or not extra):  # KL loss or KL statistic
            extra.append("ref_log_probs")
        calls.append(self._call_balanced("actor", "update", batch.select(*fields, *extra, meta=False)))
        metrics: dict[str, float] = {}
        for p in calls:
            per_rank = p.future.get()
            timing = {}
            for m in per_rank:
                for op, (s, e) in m.pop("timing").items():
                    old = timing.get(op, [s, e])
                    timing[op] = [min(old[0], s), max(old[1], e)]
            self._record(p.role, self._group_name(p.role), timing)
            for k in per_rank[0]:
                metrics[f"{p.role}/{k}"] = sum(float(m[k]) for m in per_rank) / len(per_rank)
        if "actor/kl" in metrics and "kl" not in self.stats:  # one pass: KL(π_old ‖ π_ref) from the update
            self.stats["kl"] = metrics["actor/kl"]
        return metrics

    def update_lagrange(self, batch: Batch) -> None:
        if self.lagrange is None:
            raise HflowError("safe-rlhf needs a Lagrange multiplier")
        self.stats["lagrange"] = self.lagrange.update(batch["cost_scores"].float().mean().item())
