"""Where the actor's rollout runs, and how one is launched, collected and given the current weights.

Two places (the plan's `generate_group`), one interface for the execution modes (rl/modes/):

- the actor's own devices (no `generate_group`): the actor's hybrid engine generates and reshards its
  own weights inside the call (the `reshard` op), so `sync_weights` has nothing to do;
- rollout devices of its own: RolloutWorkers (workers/rollout.py) in the group ROLLOUT generate, and
  `sync_weights` sends them the actor's weights over a weight-sync group spanning the actor's rank 0
  and every rollout rank (engines/rollout/weight_sync.py) — the `weight_sync` op in the measured
  Timeline, on the lane of both groups ("actor_group+rollout_group"), its bytes those each rollout
  rank receives (the simulator's convention: bytes per receiving device); the metric
  `weight_sync/bytes` is the sum over the rollout ranks.

A rollout is split into one prompt shard per generation replica; each replica's tp rank 0 is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.calls import CallFuture, get_all
from hybridflow.runtime.controller.protocols import join, shard
from hybridflow.runtime.controller.resource_pool import ResourcePool
from hybridflow.runtime.controller.timing import merge_timings, timing_of
from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup
from hybridflow.runtime.engines.rollout.base import RolloutSettings
from hybridflow.runtime.engines.rollout.weight_sync import DEFAULT_BUCKET_BYTES
from hybridflow.runtime.rl.batches import PROMPT_FIELDS
from hybridflow.runtime.rl.plan_support import rollout_parallel
from hybridflow.runtime.rl.recorder import OpRecorder
from hybridflow.runtime.workers.rollout import RolloutWorker
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import ROLLOUT


@dataclass
class PendingRollout:
    batch: Batch  # the prompts
    future: CallFuture
    pad: int  # rows padded to split the prompts evenly over the replicas
    iteration: int  # its ops' iteration in the Timeline: the launching one, until a mode sets the one it serves


def start_rollout_group(plan: Plan, pool: ResourcePool, model_path: str, rollout: RolloutSettings, seed: int,
                        on_role=None) -> WorkerGroup:
    """The RolloutWorkers of the actor's generate_group, loading the actor's initial weights, in the engine
    the actor's `rollout` names."""
    spec = RoleSpec(RolloutWorker, rollout_parallel(plan), (model_path,), dict(rollout=rollout, seed=seed))
    return WorkerGroup(pool, {ROLLOUT: spec}, name=pool.name, on_role=on_role)


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

    def send(self, version: int) -> tuple[list, list]:
        """Both sides at once, watched together: a worker lost on either is reported at once, not after
        the other side's collective times out. Returns (the senders' outputs, the receivers')."""
        send = self.actor.call_async("actor", "send_weights", self.specs, self.bucket_bytes)
        receive = self.rollout.call_async(ROLLOUT, "receive_weights", version, self.bucket_bytes)
        return get_all([send, receive], self.actor.call_timeout)


class RolloutDevices:
    """The group that generates the actor's rollouts, as the plan places it."""

    def __init__(self, plan: Plan, groups: dict[str, WorkerGroup], recorder: OpRecorder):
        self.plan, self.recorder = plan, recorder
        separate = plan.roles["actor"].generate_group is not None
        self.role = ROLLOUT if separate else "actor"
        self.group = groups[self.role]
        self.sync = WeightSync(groups["actor"], self.group) if separate else None
        self.synced_version = -1  # the actor updates the rollout weights have seen (-1: not yet synced)
        self._ranks: list[tuple[int, int]] | None = None  # (replica, tp rank) of each rank

    def sync_weights(self, version: int, stats: dict[str, float]) -> None:
        """The weights after `version` actor updates onto the rollout devices (no-op when there already,
        or when the actor generates itself)."""
        if self.sync is None or self.synced_version == version:
            return
        sent, received = self.sync.send(version)
        got = [timing_of(r) for r in received]
        self.recorder.log("weight_sync", "actor")
        self.recorder.record("actor", self.sync.lane, merge_timings([timing_of(s) for s in sent] + got))
        stats["weight_sync/bytes"] = float(sum(t["weight_sync"][2] for t in got))
        self.synced_version = version

    def launch(self, batch: Batch, iteration: int, greedy: bool = False, sample_round: int = 0) -> PendingRollout:
        """A rollout on its way (`collect` waits for it). greedy (ReMax's baseline): one response per
        prompt, not per sample (its consecutive copies)."""
        if greedy:
            batch = batch[torch.arange(0, len(batch), self.plan.workload.samples_per_prompt)]
        if self._ranks is None:
            self._ranks = self.group.call(self.role, "generation_ranks")
        replicas = 1 + max(rep for rep, _ in self._ranks)
        shards, pad = shard(batch.select(*PROMPT_FIELDS, meta=False), replicas)
        self.recorder.log("generate_baseline" if greedy else "generate", "actor")
        future = self.group.call_async(self.role, "generate", [shards[rep] for rep, _ in self._ranks],
                                       iteration=iteration, greedy=greedy, sample_round=sample_round)
        return PendingRollout(batch, future, pad, iteration)

    def collect(self, pending: PendingRollout) -> Batch:
        """The prompts with their responses; the ops span from the first replica's start to the last one's end."""
        outs = pending.future.get(self.group.call_timeout)
        readers = [r for _, r in sorted((rep, r) for r, (rep, tp) in enumerate(self._ranks) if tp == 0)]
        self.recorder.record_outputs("actor", self.group.name, [outs[r] for r in readers], pending.iteration)
        return pending.batch.union(join([outs[r] for r in readers], pending.pad))
