"""Dataflow: the ops an algorithm's driver loop calls, each one call on the worker group the plan names.

The algorithms (simulator/algorithms/, one file each) are short loops over these ops; the
simulator runs the same loops on a recording dataflow, so every call made here is in the graph it
prices (tests compare `calls`, the (op, role) of each call in issue order, with that graph). Ops on
disjoint groups overlap: `ref_logprob`, `actor_logprob` and `values` return pending calls that
`gather` waits for together, and `update` steps the critics and the actor at the same time. Every
op lands in the measured Timeline with the worker's own start and end (workers time themselves:
controller/timing.py; recorder.py keeps the record); rule-based scores and advantages run in the
driver (group "driver"). Where the rollouts run and when they are generated is the execution mode's
(rl/modes/, chosen by Plan.mode, driving rl/rollout.py's RolloutDevices).
Algorithm-specific steps are the entry's hooks (Safe-RLHF's λ, DAPO's group filter), called here.

With an `agent` section a rollout is conversations (docs/agents.md; rl/rollout.py runs them): every op
reads `response_mask`, which marks only the tokens the model generated; a rule-based reward reads each
conversation's last model turn (agents/trainer_rollout.final_turns); an environment's per-turn rewards
(`token_rewards`) join the reward stream's score and land on their turns' last tokens.

With one PPO epoch of one mini-batch and no KL in the reward, `actor_logprob` is skipped: the
actor's update takes its own log-probs, detached, as the old ones and reports the KL statistic
(the simulator's dataflow applies the same rule, simulator/dataflow.needs_old_logprob_pass).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hybridflow.runtime.agents.trainer_rollout import (
    ConversationRollout,
    conversation_stats,
    final_turns,
    is_conversation_batch,
)
from hybridflow.runtime.algorithms.advantages import get_advantage_estimator, overlong_penalty
from hybridflow.runtime.algorithms.functional import masked, masked_mean
from hybridflow.runtime.algorithms.losses import KLController, kl_penalty, scores_to_token_rewards
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.calls import CallFuture
from hybridflow.runtime.controller.worker_group import WorkerGroup
from hybridflow.runtime.engines.train.packing import inverse_order
from hybridflow.runtime.rl.batches import (
    RETURN_FIELD,
    SEQ_FIELDS,
    VALUE_FIELD,
    batch_origin,
    dp_balanced_order,
    left_pad_prompts,
    rule_scores,
)
from hybridflow.runtime.rl.modes import MODES
from hybridflow.runtime.rl.partial_rollouts import PartialRollouts
from hybridflow.runtime.rl.recorder import OpRecorder
from hybridflow.runtime.rl.rollout import RolloutDevices
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.runtime.rl.stops import cut_at_stops
from hybridflow.runtime.tasks.reward_pool import ScoringPool
from hybridflow.runtime.tasks.rewards import check_finite_scores
from hybridflow.runtime.tasks.tokenizer import Tokenizer
from hybridflow.simulator.algorithms import get_algorithm
from hybridflow.simulator.vocabulary.execution import needs_old_logprob_pass
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import CRITIC_OF


@dataclass
class Pending:
    role: str
    future: CallFuture
    back: torch.Tensor | None = None  # rows of the result in the batch's order (after a balanced call)
    rename: dict[str, str] = field(default_factory=dict)  # result field → batch field


class Dataflow:
    def __init__(self, plan: Plan, groups: dict[str, WorkerGroup], config: RunConfig, tokenizer: Tokenizer,
                 functions: dict | None = None, prompts: Callable[[int | None], Batch] | None = None,
                 origin: float | None = None):
        """config: the run's settings resolved for the plan's algorithm (rl/resolve.py); functions:
        rule-based scores by stream ("reward", "cost"); prompts(n): n more prompts (None: a batch's
        worth), each repeated samples_per_prompt times (dynamic sampling, pipelined modes); origin: the
        run's clock (the Timeline's 0)."""
        self.plan, self.groups, self.config, self.tok = plan, groups, config, tokenizer
        self.algo = get_algorithm(plan.algorithm)
        self.functions, self.prompts = functions or {}, prompts
        self.recorder = OpRecorder(origin)
        self.state = self.algo.hooks.driver_state(config)  # e.g. Safe-RLHF's Lagrange multiplier
        self.kl = KLController(config.kl)
        self.old_logprob_pass = needs_old_logprob_pass(plan.workload, plan.reference_roles(), config.kl_in_reward)
        conversations = None
        if config.agent.enabled:  # the actor's HF tokenizer with its chat template (checked by check_runnable)
            conversations = ConversationRollout(config.agent, tokenizer.hf, tokenizer.eos_ids, tokenizer.pad_id,
                                                config.seed)
        self.rollout = RolloutDevices(plan, groups, self.recorder, conversations)
        budget = config.async_mode.partial_rollout_tokens  # async only (check_runnable)
        extra = {"partial": PartialRollouts(budget, plan.workload.response_len, tokenizer.eos_ids,
                                            tokenizer.pad_id)} if budget and plan.mode == "async" else {}
        self.mode = MODES[plan.mode](self.rollout, plan.workload, prompts, plan.staleness, **extra)
        self.start_iteration(0)

    def start_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.stats: dict[str, float] = {}
        self.recorder.start_iteration(iteration)
        self.mode.start_iteration(iteration, self.stats)
        self.rollout_scores: torch.Tensor | None = None  # fill_batch: the first round's rewards, unfiltered

    # ---- bookkeeping --------------------------------------------------------------------------
    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.recorder.calls

    @property
    def resampled_calls(self) -> list[tuple[str, str]]:
        return self.recorder.resampled_calls

    @property
    def events(self):
        return self.recorder.events

    @property
    def origin(self) -> float:
        return self.recorder.origin

    def has(self, role: str) -> bool:
        return role in self.groups

    def _group_name(self, role: str) -> str:
        return self.plan.roles[role].group

    @contextmanager
    def _on_driver(self, op: str, role: str):
        self.recorder.log(op, role)
        start = time.time()
        yield
        self.recorder.span(op, role, start)

    def _call(self, op: str, role: str, method: str, batch: Batch) -> Pending:
        self.recorder.log(op, role)
        return Pending(role, self.groups[role].call_async(role, method, batch))

    def _call_balanced(self, op: str, role: str, method: str, batch: Batch) -> Pending:
        """`_call` with the rows spread evenly over the role's dp ranks; results come back in batch order."""
        rp = self.plan.roles[role]  # a packing role shares no prompts: its rows balance one by one
        order = dp_balanced_order(batch["attention_mask"], rp.train.dp,
                                  1 if rp.micro_batch_tokens else self.plan.workload.samples_per_prompt)
        if order is None:
            return self._call(op, role, method, batch)
        self.recorder.log(op, role)
        return Pending(role, self.groups[role].call_async(role, method, batch[order]), inverse_order(order))

    # ---- rollout ------------------------------------------------------------------------------
    def generate(self, batch: Batch, greedy: bool = False, sample_round: int = 0) -> Batch:
        """Responses for the prompts, as the execution mode makes them (rl/modes/). greedy (ReMax's
        baseline): one response per prompt, not per sample."""
        out = cut_at_stops(self.mode.generate(batch, greedy, sample_round), self.tok, self.config.sampling.stop)
        if is_conversation_batch(out) and not greedy and not sample_round:
            self.stats.update(conversation_stats(out))
        return out

    # ---- scores -------------------------------------------------------------------------------
    def _rule_scores(self, batch: Batch, stream: str) -> torch.Tensor:
        with self._on_driver(stream, stream):
            ref, fn = getattr(self.plan, f"{stream}_function"), self.functions[stream]
            read = final_turns(batch) if is_conversation_batch(batch) else batch  # a conversation: its answer
            scores = rule_scores(fn, read, self.tok, f"{stream} function '{ref}'")
            if isinstance(fn, ScoringPool) and fn.config.timeout_s:
                self.stats[f"{stream}/timeouts"] = self.stats.get(f"{stream}/timeouts", 0.0) + fn.timeouts
            return scores

    def score(self, batch: Batch) -> Batch:
        """`reward_scores` (and `cost_scores` for a constrained algorithm): score models first, then the
        rule-based functions on the driver while the models work. A score that is not a finite number
        ends the run with a one-line error."""
        streams = self.algo.scores
        models = [s for s in streams if self.has(s)]
        pending = [self._call(s, s, "compute_scores", batch.select(*SEQ_FIELDS, meta=False)) for s in models]
        for s in streams:
            if not self.has(s):
                batch[f"{s}_scores"] = self._rule_scores(batch, s)
        batch = self.gather(batch, *pending)
        if "token_rewards" in batch:  # an environment's rewards, per turn: part of the reward
            batch["reward_scores"] = batch["reward_scores"].float() + batch["token_rewards"].sum(-1)
        for s in models:
            check_finite_scores(batch[f"{s}_scores"], f"{s} model {self.plan.roles[s].path}", list(batch["prompt"]),
                                **batch_origin(batch))
        return batch

    def fill_batch(self, batch: Batch) -> Batch:
        """Dynamic sampling: keep the prompt groups the algorithm's `keep_groups` hook accepts and top the
        batch up with groups of new prompts (generated and scored the same way) for at most
        workload.max_sampling_rounds rounds in all; what is still missing then is filled with the
        rejected groups, so the batch keeps its size. Kept groups come first."""
        group = self.plan.workload.samples_per_prompt
        want = len(batch) // group
        kept, rejected, n_kept, rounds, generated = [], [], 0, 1, want
        self.rollout_scores = batch["reward_scores"]
        while True:
            scores = batch["reward_scores"].float().view(-1, group)
            keep = self.algo.hooks.keep_groups(scores)
            if keep is None:
                return batch
            rows = keep.repeat_interleave(group)
            kept.append(batch[rows.nonzero().flatten()])
            rejected.append(batch[(~rows).nonzero().flatten()])
            n_kept += int(keep.sum())
            if n_kept >= want or rounds >= self.plan.workload.max_sampling_rounds or self.prompts is None:
                break
            self.recorder.resampling = True
            try:
                batch = self.score(self.generate(self.prompts(want - n_kept), sample_round=rounds))
            finally:
                self.recorder.resampling = False
            rounds, generated = rounds + 1, generated + (want - n_kept)
        parts = [b for b in kept + rejected if len(b)]
        width = max(b["prompt_ids"].shape[1] for b in parts)
        full = Batch.concat([left_pad_prompts(b, width) for b in parts])[: want * group]
        self.stats.update({"sampling/rounds": float(rounds), "sampling/kept_groups": float(min(n_kept, want)),
                           "sampling/filter_rate": 1.0 - n_kept / generated})
        return full

    # ---- log-probs and values -----------------------------------------------------------------
    def ref_logprob(self, batch: Batch) -> Pending | None:
        if self.plan.ref_from_actor:  # a LoRA actor: its base model, adapters off
            return self._call_balanced("ref_logprob", "actor", "compute_ref_log_prob",
                                       batch.select(*SEQ_FIELDS, meta=False))
        if not self.has("ref"):
            return None
        return self._call_balanced("ref_logprob", "ref", "compute_log_prob", batch.select(*SEQ_FIELDS, meta=False))

    def actor_logprob(self, batch: Batch) -> Pending | None:
        """The old log-probs, unless the update's own serve (one epoch of one mini-batch, no KL in the reward)."""
        if not self.old_logprob_pass:
            return None
        return self._call_balanced("actor_logprob", "actor", "compute_log_prob",
                                   batch.select(*SEQ_FIELDS, meta=False))

    def values(self, batch: Batch, critic: str = "critic") -> Pending | None:
        if not self.has(critic):
            return None
        p = self._call_balanced("values", critic, "compute_values", batch.select(*SEQ_FIELDS, meta=False))
        p.rename = {"values": VALUE_FIELD[critic]}
        return p

    def gather(self, batch: Batch, *pending: Pending | None) -> Batch:
        for p in pending:
            if p is not None:
                out = p.future.get()
                self.recorder.record_outputs(p.role, self._group_name(p.role), [out])
                out = out if p.back is None else out[p.back]
                if p.rename:
                    out = Batch({p.rename.get(k, k): v for k, v in out.tensors.items()})
                batch = batch.union(out)
        return batch

    # ---- advantages ---------------------------------------------------------------------------
    def _shaped(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.config.shaping
        if s.overlong_buffer is None:
            return scores
        budget = self.plan.workload.response_len
        return scores + overlong_penalty(mask.sum(-1), budget, s.overlong_buffer, s.overlong_penalty)

    def advantage(self, batch: Batch, baseline: Batch | None = None) -> Batch:
        """Each score stream's advantages by the run's estimator (with its critic's values), combined by the
        algorithm's hook; each critic's returns. `baseline`: ReMax's scored greedy rollout."""
        cfg, w, hooks = self.config, self.plan.workload, self.algo.hooks
        with self._on_driver("advantage", "driver"):
            mask = batch["response_mask"]
            scores = {s: batch[f"{s}_scores"].float() for s in self.algo.scores}
            scores["reward"] = self._shaped(scores["reward"], mask)
            self.stats.update(hooks.on_scores(self.state, scores))
            have_kl = "ref_log_probs" in batch and "old_log_probs" in batch
            if have_kl:  # else the update reports it
                self.stats["kl"] = masked_mean(batch["old_log_probs"] - batch["ref_log_probs"], mask).item()
            kl = None
            if cfg.kl_in_reward and have_kl:
                kl = masked(kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], cfg.kl.estimator), mask)
            estimator = get_advantage_estimator(cfg.advantage.estimator)
            advantages = {}
            env = batch["token_rewards"] if "token_rewards" in batch else None  # an environment's, on their turns
            for s in self.algo.scores:
                if s == "reward" and env is not None:
                    rewards = scores_to_token_rewards(scores[s] - env.sum(-1), mask) + env
                else:
                    rewards = scores_to_token_rewards(scores[s], mask)
                if kl is not None:
                    rewards = rewards - hooks.kl_shares.get(s, 0.0) * self.kl.value * kl
                critic = CRITIC_OF[s]
                advantages[s], returns = estimator(
                    rewards, mask, cfg.advantage, values=batch[VALUE_FIELD[critic]] if self.has(critic) else None,
                    group_size=w.samples_per_prompt,
                    baseline=None if baseline is None else  # one greedy score per prompt, for each of its samples
                    baseline[f"{s}_scores"].float().repeat_interleave(w.samples_per_prompt))
                if self.has(critic):
                    batch[RETURN_FIELD[critic]] = returns
            batch["advantages"] = hooks.combine(advantages, self.state)
            if kl is not None:
                self.stats["kl_coef"] = self.kl.value
                self.kl.update(masked_mean(kl, mask).item(), len(batch))
        return batch

    # ---- updates ------------------------------------------------------------------------------
    def update(self, batch: Batch) -> dict[str, float]:
        """The critics' and the actor's steps, concurrently when they live on disjoint groups."""
        fields = [*SEQ_FIELDS, "response_mask", "advantages"]
        calls = []
        for s in self.algo.scores:
            critic = CRITIC_OF[s]
            if self.has(critic):
                sub = Batch({**{k: batch[k] for k in fields}, "values": batch[VALUE_FIELD[critic]],
                             "returns": batch[RETURN_FIELD[critic]]})
                calls.append(self._call_balanced("critic_update", critic, "update", sub))
        batch = self.mode.before_update(batch)
        extra = [k for k in ("old_log_probs", "behaviour_log_probs") if k in batch]  # behaviour: off-policy
        if "ref_log_probs" in batch and (self.config.kl.placement == "loss" or "old_log_probs" not in batch):
            # a KL loss term, or the KL statistic of a one-pass update
            extra.append("ref_log_probs")
        calls.append(self._call_balanced("actor_update", "actor", "update", batch.select(*fields, *extra, meta=False)))
        self.mode.update_submitted()
        metrics: dict[str, float] = {}
        for p in calls:
            per_rank = p.future.get()
            self.recorder.record_outputs(p.role, self._group_name(p.role), per_rank)
            for k in per_rank[0]:
                metrics[f"{p.role}/{k}"] = sum(float(m[k]) for m in per_rank) / len(per_rank)
        if "actor/kl" in metrics and "kl" not in self.stats:  # one pass: KL(π_old ‖ π_ref) from the update
            self.stats["kl"] = metrics["actor/kl"]
        return metrics
