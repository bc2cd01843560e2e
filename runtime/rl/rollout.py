"""Where the actor's rollout runs, and how one is launched, collected and given the current weights.

Two places (the plan's `generate_group`), one interface for the execution modes (rl/modes/):

- the actor's own devices (no `generate_group`): the actor's hybrid engine generates and reshards its
  own weights inside the call (the `reshard` op), so `sync_weights` has nothing to do;
- rollout devices of its own: RolloutWorkers (workers/rollout.py) in the group ROLLOUT generate, and
  `sync_weights` sends them the actor's weights over a weight-sync group spanning the actor's rank 0
  and every rollout rank (engines/rollout/weight_sync.py) — the `weight_sync` op in the measured
  Timeline, on the lane of both groups ("actor_group+rollout_group"), its bytes those each rollout
  rank receives (the simulator's convention: bytes per receiving device); the metric
  `weight_sync/bytes` is the sum over the rollout ranks. `hand_over` submits a sync ahead, behind the
  update that makes its weights (the async mode's partial rollouts, which sync every iteration), and the
  next `sync_weights` waits for it.

A rollout is split into one prompt shard per generation replica; each replica's tp rank 0 is read.

With an `agent` section (docs/agents.md) a rollout is conversations (agents/trainer_rollout.py): the
loop runs on the driver, in a thread of its own per rollout in flight, so an asynchronous mode's
rollout runs on while the driver trains; each model turn is one `generate` call on the group (each
call's sampling round its own: the rollout's round · TURN_CALLS + the call's index) and tools run on
the driver's thread pool while the next call decodes the conversations that are not waiting. Calls of
rollouts in flight together go one at a time (a lock), so every rank of the group serves them in the
same order. The rollout's `generate` op spans its first call's start to its last call's end.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hybridflow.runtime.agents.trainer_rollout import ConversationRollout, TurnOutput
from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.calls import CallFuture, get_all
from hybridflow.runtime.controller.protocols import join, shard
from hybridflow.runtime.controller.resource_pool import ResourcePool
from hybridflow.runtime.controller.timing import merge_timings, timing_of
from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup
from hybridflow.runtime.engines.rollout.base import RolloutSettings
from hybridflow.runtime.engines.rollout.generation import FORCED_LENGTH_FIELD
from hybridflow.runtime.engines.rollout.weight_sync import DEFAULT_BUCKET_BYTES
from hybridflow.runtime.rl.batches import PROMPT_FIELDS
from hybridflow.runtime.rl.plan_support import rollout_parallel
from hybridflow.runtime.rl.recorder import OpRecorder
from hybridflow.runtime.workers.rollout import RolloutWorker
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import ROLLOUT

TURN_CALLS = 100_000  # generate calls one conversation rollout may make (its calls' sampling rounds)


@dataclass
class PendingRollout:
    batch: Batch  # the prompts
    future: CallFuture | Future  # a Future: conversations, run on a driver thread (-> (batch, call outputs))
    pad: int  # rows padded to split the prompts evenly over the replicas
    iteration: int  # its ops' iteration in the Timeline: the launching one, until a mode sets the one it serves


@dataclass
class GroupGenerate:
    """`generate(ids, mask, params, generator)` for the conversation loop: one `generate` call on the rollout's
    group per model turn (the workers sample with their own settings and seeds; params and generator are
    not sent)."""

    devices: RolloutDevices
    iteration: int
    greedy: bool
    sample_round: int
    behaviour: bool  # the workers return the sampler's log-probs (rollout devices)
    calls: int = 0
    outputs: list = field(default_factory=list)  # the replicas' outputs of every call (their timings)
    versions: set[int] = field(default_factory=set)  # the policy versions that answered

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, params=None, generator=None) -> TurnOutput:
        d = self.devices
        with d.call_lock:
            pending = d.submit(Batch({"prompt_ids": ids, "prompt_mask": mask}), self.iteration, self.greedy,
                               self.sample_round * TURN_CALLS + self.calls)
            outs = d.replica_outputs(pending.future.get(d.group.call_timeout))
        self.calls += 1
        self.outputs += outs
        out = join(outs, pending.pad)
        if "policy_version" in out:
            self.versions.update(out["policy_version"].tolist())
        logprobs = out["behaviour_log_probs"] if self.behaviour else torch.zeros(out["responses"].shape)
        return TurnOutput(out["responses"], out["response_mask"], logprobs)


def start_rollout_group(plan: Plan, pool: ResourcePool, model_path: str, rollout: RolloutSettings, seed: int,
                        on_role=None, start: bool = True) -> WorkerGroup:
    """The RolloutWorkers of the actor's generate_group, loading the actor's initial weights, in the engine
    the actor's `rollout` names (`start=False`: see WorkerGroup)."""
    spec = RoleSpec(RolloutWorker, rollout_parallel(plan), (model_path,), dict(rollout=rollout, seed=seed))
    return WorkerGroup(pool, {ROLLOUT: spec}, name=pool.name, on_role=on_role, start=start)


class WeightSync:
    """The actor's weights onto every rank of the rollout group, bucket by bucket."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.actor, self.rollout, self.bucket_bytes = actor, rollout, bucket_bytes
        self.specs = rollout.call(ROLLOUT, "weight_specs")[0]
        self.model_bytes = sum(s.nbytes for s in self.specs)
        world = 1 + rollout.world_size
        addr, port = actor.call("actor", "open_weight_sync", world)[0]  # held by the sender (rank 0)
        get_all([actor.call_async("actor", "init_weight_sync", addr, port, world),  # every member at once
                 rollout.call_async(ROLLOUT, "init_weight_sync", addr, port, world)], actor.call_timeout)
        self.lane = f"{actor.name}+{rollout.name}"

    def submit(self, version: int) -> list[CallFuture]:
        """Both sides' calls, each queued behind the calls its workers have in hand (`finish` waits)."""
        return [self.actor.call_async("actor", "send_weights", self.specs, self.bucket_bytes),
                self.rollout.call_async(ROLLOUT, "receive_weights", version, self.bucket_bytes)]

    def finish(self, calls: list[CallFuture]) -> tuple[list, list]:
        """Both sides watched together: a worker lost on either is reported at once, not after the other
        side's collective times out. Returns (the senders' outputs, the receivers')."""
        return get_all(calls, self.actor.call_timeout)


class RolloutDevices:
    """The group that generates the actor's rollouts, as the plan places it."""

    def __init__(self, plan: Plan, groups: dict[str, WorkerGroup], recorder: OpRecorder,
                 conversations: ConversationRollout | None = None):
        self.plan, self.recorder, self.conversations = plan, recorder, conversations
        separate = plan.roles["actor"].generate_group is not None
        self.role = ROLLOUT if separate else "actor"
        self.group = groups[self.role]
        self.sync = WeightSync(groups["actor"], self.group) if separate else None
        self.synced_version = -1  # the actor updates the rollout weights have seen (-1: not yet synced)
        self.handover: tuple[int, list[CallFuture]] | None = None  # a sync submitted ahead (hand_over): version, calls
        self._ranks: list[tuple[int, int]] | None = None  # (replica, tp rank) of each rank
        self.call_lock = threading.Lock()  # conversation rollouts' calls, one at a time
        self._threads: ThreadPoolExecutor | None = None  # where conversation rollouts run

    def hand_over(self, version: int) -> None:
        """Submit the sync of the weights after `version` updates now, while the update that makes them is
        still running: each side's call queues behind the one its workers have in hand (the actor's update,
        the rollout's call in flight), so the trainers hand over the moment their update ends, without a
        round trip through the driver. `sync_weights` waits for it (and records it)."""
        if self.sync is not None and self.handover is None and self.synced_version != version:
            self.handover = (version, self.sync.submit(version))

    def sync_weights(self, version: int, stats: dict[str, float]) -> None:
        """The weights after `version` actor updates onto the rollout devices (no-op when there already,
        or when the actor generates itself); a sync handed over ahead is waited for first."""
        if self.sync is None:
            return
        self.finish_handover(stats)
        if self.synced_version != version:
            self._synced(version, self.sync.submit(version), stats)

    def finish_handover(self, stats: dict[str, float]) -> None:
        """Wait for the sync handed over ahead, if one is on its way (recorded in this iteration)."""
        if self.handover is not None:
            handed, calls = self.handover
            self.handover = None
            self._synced(handed, calls, stats)

    def _synced(self, version: int, calls: list[CallFuture], stats: dict[str, float]) -> None:
        sent, received = self.sync.finish(calls)
        got = [timing_of(r) for r in received]
        self.recorder.log("weight_sync", "actor")
        self.recorder.record("actor", self.sync.lane, merge_timings([timing_of(s) for s in sent] + got))
        stats["weight_sync/bytes"] = float(sum(t["weight_sync"][2] for t in got))
        self.synced_version = version

    @property
    def replicas(self) -> int:
        if self._ranks is None:
            self._ranks = self.group.call(self.role, "generation_ranks")
        return 1 + max(rep for rep, _ in self._ranks)

    def submit(self, batch: Batch, iteration: int, greedy: bool, sample_round: int) -> PendingRollout:
        """One `generate` call on the group: the prompts sharded over the replicas."""
        fields = (*PROMPT_FIELDS, *((FORCED_LENGTH_FIELD,) if FORCED_LENGTH_FIELD in batch else ()))
        shards, pad = shard(batch.select(*fields, meta=False), self.replicas)
        future = self.group.call_async(self.role, "generate", [shards[rep] for rep, _ in self._ranks],
                                       iteration=iteration, greedy=greedy, sample_round=sample_round)
        return PendingRollout(batch, future, pad, iteration)

    def replica_outputs(self, outs: list) -> list:
        """Each replica's output (its tp rank 0's), in replica order."""
        return [outs[r] for _, r in sorted((rep, r) for r, (rep, tp) in enumerate(self._ranks) if tp == 0)]

    def launch(self, batch: Batch, iteration: int, greedy: bool = False, sample_round: int = 0) -> PendingRollout:
        """A rollout on its way (`collect` waits for it). greedy (ReMax's baseline): one response per
        prompt, not per sample (its consecutive copies)."""
        if greedy:
            batch = batch[torch.arange(0, len(batch), self.plan.workload.samples_per_prompt)]
        self.recorder.log("generate_baseline" if greedy else "generate", "actor")
        if self.conversations is None:
            return self.submit(batch, iteration, greedy, sample_round)
        generate = GroupGenerate(self, iteration, greedy, sample_round, behaviour=self.sync is not None)
        if self._threads is None:
            self._threads = ThreadPoolExecutor(thread_name_prefix="hflow-conversations")

        def converse():
            out = self.conversations.run(batch, generate, iteration * TURN_CALLS + sample_round,
                                         lambda: generate.versions)
            return out, generate.outputs

        return PendingRollout(batch, self._threads.submit(converse), 0, iteration)

    def collect(self, pending: PendingRollout) -> Batch:
        """The prompts with their responses; the ops span from the first replica's start to the last one's end."""
        if isinstance(pending.future, Future):  # conversations: the batch is theirs (prompts rendered with tools)
            batch, outputs = pending.future.result()
            self.recorder.record_outputs("actor", self.group.name, outputs, pending.iteration)
            return batch
        outs = self.replica_outputs(pending.future.get(self.group.call_timeout))
        self.recorder.record_outputs("actor", self.group.name, outs, pending.iteration)
        return pending.batch.union(join(outs, pending.pad))

    def close(self) -> None:
        """No new conversation rollouts; those in flight end with their calls (the groups' shutdown)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
