"""Generation on the actor's own rollout devices (a plan's `generate_group`), synchronous or one step off.

The actor trains on its group; RolloutWorkers (workers/rollout.py) generate on theirs. After each
actor update the weights go over the weight-sync group (weight_sync.py, spanning the actor's rank
0 and every rollout rank) before the next rollout: the `weight_sync` op in the measured Timeline,
on the lane of both groups ("actor_group+rollout_group"), its bytes those each rollout rank receives
(the model's: the simulator's convention, bytes per receiving device); the metric
`weight_sync/bytes` is the sum over the rollout ranks.

Modes (Plan.mode):
- `sync`: each iteration syncs the newest weights and then generates its batch — on-policy, the
  trainers idle while the rollout runs.
- `one-step-off`: the batch of iteration i+1 is generated while the actor trains on batch i.
  Iteration i collects its batch (launched during iteration i−1), syncs the weights of i−1
  updates, launches the rollout of the next prompts and returns. A batch is therefore generated
  by a policy at most one update old (staleness ≤ 1); each row carries the version that made it
  and its behaviour log-probs, which the actor's loss corrects for (losses.behaviour_weights).
  In the measured Timeline a rollout is the iteration's whose batch it makes (it ran during the one
  before), the weight sync the iteration's that issued it, as the simulator labels them (timeline.py).
  Prompts keep the synchronous order: the first iteration draws the second batch's prompts
  itself; after that the prompts the trainer hands iteration i are the ones it launches.

A checkpoint taken while a look-ahead rollout runs saves the prompt order from before its prompts:
a resumed run draws them again and generates them with the checkpoint's weights, so no batch is
lost or trained twice.

Dynamic sampling's extra rounds and ReMax's greedy baseline generate synchronously (they queue
behind a rollout in flight). An extra round's prompts are drawn after the look-ahead's and trained
in this iteration, so the checkpoint also tells the sampler to jump over them once the resumed run
has drawn the look-ahead's again (`prompts_drawn_after_in_flight`).
"""

from __future__ import annotations

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.calls import get_all
from hybridflow.runtime.controller.resource_pool import ResourcePool
from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup
from hybridflow.runtime.engines.rollout.generation import SamplingParams
from hybridflow.runtime.engines.rollout.weight_sync import DEFAULT_BUCKET_BYTES
from hybridflow.runtime.rl.dataflow import Dataflow, PendingRollout
from hybridflow.runtime.rl.plan_support import rollout_parallel
from hybridflow.runtime.workers.rollout import RolloutWorker
from hybridflow.simulator.vocabulary.plan import Plan

ROLLOUT = "rollout"  # the rollout group's role name (not a plan role: the actor's generation)


def start_rollout_group(plan: Plan, pool: ResourcePool, model_path: str, sampling: SamplingParams, seed: int,
                        on_role=None) -> WorkerGroup:
    """The RolloutWorkers of the actor's generate_group, loading the actor's initial weights, in the engine
    the actor's `rollout` names."""
    spec = RoleSpec(RolloutWorker, rollout_parallel(plan), (model_path,),
                    dict(sampling=sampling, seed=seed, backend=plan.roles["actor"].rollout,
                         prompt_len=plan.workload.prompt_len))
    return WorkerGroup(pool, {ROLLOUT: spec}, name=pool.name, on_role=on_role)


class DisaggregatedDataflow(Dataflow):
    rollout_role = ROLLOUT

    def __init__(self, *args, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **kwargs):
        super().__init__(*args, **kwargs)
        self.bucket_bytes = bucket_bytes
        actor, rollout = self.groups["actor"], self.groups[ROLLOUT]
        self.specs = rollout.call(ROLLOUT, "weight_specs")[0]
        self.model_bytes = sum(s.nbytes for s in self.specs)
        world = 1 + rollout.world_size
        addr, port = actor.call("actor", "open_weight_sync", world)[0]  # held by the sender (rank 0)
        get_all([actor.call_async("actor", "init_weight_sync", addr, port, world),  # every member at once
                 rollout.call_async(ROLLOUT, "init_weight_sync", addr, port, world)], actor.call_timeout)
        self.synced_version = -1  # the actor updates the rollout weights have seen (-1: not yet synced)
        self.ahead: PendingRollout | None = None  # one-step-off: the next iteration's rollout, in flight
        self.drawn_after_ahead = 0  # prompts drawn (by dynamic sampling's rounds) since its launch
        self.lane = f"{actor.name}+{rollout.name}"

    @property
    def version(self) -> int:
        """The actor updates done before this iteration's own."""
        return self.iteration - 1

    def sync_weights(self) -> None:
        """The actor's current weights onto every rollout rank (no-op when they are already there)."""
        if self.synced_version == self.version:
            return
        actor, rollout = self.groups["actor"], self.groups[ROLLOUT]
        send = actor.call_async("actor", "send_weights", self.specs, self.bucket_bytes)
        receive = rollout.call_async(ROLLOUT, "receive_weights", self.version, self.bucket_bytes)
        # both sides watched together: a worker lost on either is reported at once, not after the
        # other side's collective times out
        sent, got = get_all([send, receive], actor.call_timeout)
        spans = [m["timing"]["weight_sync"] for m in sent + got]
        received = [m["bytes"] for m in got]
        self._log("weight_sync", "actor")
        self._record("actor", self.lane, {"weight_sync": (min(s for s, _ in spans), max(e for _, e in spans),
                                                          float(max(received)))})
        self.stats["weight_sync/bytes"] = float(sum(received))
        self.synced_version = self.version

    def generate(self, batch: Batch, greedy: bool = False, sample_round: int = 0) -> Batch:
        if self.plan.mode == "sync" or greedy or sample_round:
            if sample_round and not greedy and self.ahead is not None:
                self.drawn_after_ahead += len(batch) // self.plan.workload.samples_per_prompt
            self.sync_weights()
            return self.collect_rollout(self.launch_rollout(batch, greedy, sample_round))
        first = self.ahead is None
        if first:  # the first iteration (or the first after a resume): its batch now
            self.sync_weights()
            current = self.collect_rollout(self.launch_rollout(batch))
            upcoming = self.prompts(None) if self.prompts else batch
        else:
            self.ahead.iteration = self.iteration  # in the Timeline: the iteration whose batch it is
            current, upcoming = self.collect_rollout(self.ahead), batch
        self.sync_weights()  # the rollout devices are idle now: the newest weights, then the next batch
        # the iteration's second launch draws its own randomness (its seed: the launch's index in the iteration)
        self.ahead = self.launch_rollout(upcoming, sample_round=int(first))
        self.drawn_after_ahead = 0
        return current

    def update(self, batch: Batch) -> dict[str, float]:
        staleness = self.version - batch["policy_version"]
        self.stats.update({"staleness/max": float(staleness.max()), "staleness/mean": staleness.float().mean().item()})
        if self.plan.mode == "sync":  # on-policy: the update's own log-probs are the behaviour's
            batch = Batch(batch.tensors.exclude("behaviour_log_probs"), batch.non_tensors, batch.meta)
        return super().update(batch)

    def prompts_in_flight(self) -> int:
        return 0 if self.ahead is None else len(self.ahead.batch) // self.plan.workload.samples_per_prompt

    def prompts_drawn_after_in_flight(self) -> int:
        return self.drawn_after_ahead
