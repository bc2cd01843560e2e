"""`async`: rollout on the actor's own devices streams finished prompt groups into a bounded
queue; training takes full batches from it; no trained batch's policy is more than k updates old
(k = Plan.max_staleness).

The rollout devices generate chunks of prompt groups (a prompt's n responses, half a batch of
prompts per call by default), submitted back to back so the rollout workers run without waiting
for the driver, each chunk's groups entering the queue as it finishes. The queue is bounded: groups
ready plus groups in flight never exceed k batches. Whenever nothing is in flight (the rollout
devices are idle) the driver syncs the newest weights and submits chunks up to that bound. A chunk
submitted at version v after iteration i took its batch sits behind at most k·B − c other groups,
so it is trained within the next k iterations: staleness ≤ k by construction. The queue checks it
anyway when a batch is taken: a group older than k is dropped (not regenerated: its prompt is
skipped, counted in `async/dropped_groups`), which the launch rule above keeps from happening.

In the measured Timeline a chunk's `generate` belongs to the iteration whose batch it serves (it
ran during earlier ones). With k = 1 and chunks of a whole batch this is exactly one-step-off. Every launch decision is made
at an iteration boundary from counts, never from timing, so a run is reproducible (sampling is
seeded by the iteration and the chunk's index within it), whichever side is faster.

Checkpoints: the queue is not saved. Its prompts (ready, in flight and drawn but not launched) are
the last ones the sampler drew, so the checkpoint rewinds the data order by them
(`prompts_in_flight`): a resumed run draws them again and regenerates them with the checkpoint's
weights (the policy version the checkpoint holds), training every prompt exactly once.

Partial rollouts (run config `async_mode.partial_rollout_tokens`, rl/partial_rollouts.py): each refill is a
round of at most that many new tokens per response, in one call: the paused responses of open groups
beside the new prompts (chunks would only decode one after another, each within the budget, and the next
iteration collects the whole round anyway); a group enters the queue once all its responses have ended. Each
iteration first collects the whole last round (launched while the batch before trained), so a paused
response goes on once per iteration, and more often while the trainers wait for groups; the queue hands
out the groups with the oldest first token first. Open
groups count as in flight (in the queue's bound and in `prompts_in_flight`); a paused response too stale
to be trained within k is regenerated from its prompt when the round starts. A checkpoint saves the
buffer, the queue and the prompts not launched (`checkpoint_state`), so a resumed run goes on from them
as the uninterrupted one does.

Dynamic sampling's extra rounds take the next groups from the queue like any batch (the prompts
they draw join its end), so the prompts not yet trained stay the last ones drawn. ReMax's greedy
baseline is refused in pipelined modes (rl/plan_support.py check_runnable).
"""

from __future__ import annotations

from collections import deque

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.rl.batches import left_pad_prompts
from hybridflow.runtime.rl.modes.base import Mode
from hybridflow.runtime.rl.partial_rollouts import OpenGroup, PartialRollouts, partial_stats
from hybridflow.runtime.rl.rollout import PendingRollout
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import stream_chunk_prompts


def concat_groups(parts: list[Batch]) -> Batch:
    """Groups (or chunks) of rollouts whose left-padded prompts may differ in width, as one batch."""
    width = max(b["prompt_ids"].shape[1] for b in parts)
    return Batch.concat([left_pad_prompts(b, width) for b in parts])


class RolloutQueue:
    """Finished prompt groups in the order they were generated, each with the policy version that made it."""

    def __init__(self, group_size: int, max_staleness: int):
        self.group_size, self.max_staleness = group_size, max_staleness
        self.groups: deque[Batch] = deque()

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, rollout: Batch) -> None:
        """A finished chunk (whole groups, `policy_version` per row), split into its groups."""
        n = self.group_size
        self.groups.extend(rollout[i:i + n] for i in range(0, len(rollout), n))

    def take(self, count: int, version: int) -> tuple[list[Batch], int]:
        """Up to `count` groups, oldest first, for training at `version`; groups more than max_staleness
        versions older are dropped on the way. Returns (groups, how many were dropped)."""
        out, dropped = [], 0
        while self.groups and len(out) < count:
            group = self.groups.popleft()
            if version - int(group["policy_version"].min()) > self.max_staleness:
                dropped += 1
            else:
                out.append(group)
        return out, dropped


class Streaming(Mode):
    on_policy = False

    def __init__(self, *args, chunk_prompts: int | None = None, partial: PartialRollouts | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.partial = partial  # partial rollouts (rl/partial_rollouts.py); None: every response in one call
        w = self.workload
        self.group_size = w.samples_per_prompt
        self.chunk_prompts = chunk_prompts or stream_chunk_prompts(w.prompts)
        self.capacity = self.max_staleness * w.prompts  # groups ready + in flight
        self.queue = RolloutQueue(w.samples_per_prompt, self.max_staleness)
        self.in_flight: deque[PendingRollout] = deque()
        self.unlaunched: deque[Batch] = deque()  # prompt groups drawn, not yet submitted
        self.launched = 0  # chunks submitted in this iteration (their sampling seeds)

    def start_iteration(self, iteration: int, stats: dict[str, float]) -> None:
        super().start_iteration(iteration, stats)
        self.launched = 0

    def update_submitted(self) -> None:
        """With partial rollouts the next round starts from the weights this update makes (every iteration
        syncs): they are handed over the moment the update ends, queued behind it on the trainers and behind
        the round in flight on the rollout devices, instead of after the driver has heard back (the next
        refill waits for it). Without them a sync follows an idle rollout only, which an update cannot know."""
        if self.partial is not None:
            self.rollout.hand_over(self.iteration)

    def _groups_in_flight(self) -> int:
        """Groups launched and not yet in the queue (with partial rollouts: every open group, paused or not)."""
        if self.partial is not None:
            return len(self.partial.open)
        return sum(len(p.batch) for p in self.in_flight) // self.group_size

    def prompts_in_flight(self) -> int:
        """Prompts drawn and not yet trained: in the queue, in flight, or not yet launched."""
        return len(self.queue) + self._groups_in_flight() + len(self.unlaunched)

    def checkpoint_state(self) -> dict | None:
        """With partial rollouts, what a checkpoint saves of the mode (rl/checkpoints.py): the round in flight
        collected first (the next iteration's first step anyway), then the paused responses and finished groups
        of the buffer, the queue's groups and the prompts drawn but not launched, so that a resume goes on
        exactly as the run would have. None without partial rollouts: the checkpoint rewinds the data order
        by prompts_in_flight instead and the resumed run regenerates them."""
        if self.partial is None:
            return None
        while self.in_flight:
            self._collect_next(serves=self.iteration + 1)  # the next iteration would have collected it
        return {"queue": list(self.queue.groups), "open": list(self.partial.open),
                "unlaunched": list(self.unlaunched), "restarted": self.partial.restarted}

    def load_checkpoint_state(self, state: dict) -> None:
        """A checkpoint_state back into a fresh mode (the same plan and run config)."""
        if self.partial is None:
            raise HflowError("this checkpoint holds paused partial rollouts; resume it with the same "
                             "async_mode.partial_rollout_tokens")
        self.queue.groups, self.unlaunched = deque(state["queue"]), deque(state["unlaunched"])
        self.partial.open, self.partial.restarted = deque(state["open"]), state["restarted"]

    def _next_prompts(self, count: int) -> Batch | None:
        """Up to `count` prompt groups to launch, drawn after those the trainer handed in (None: no more)."""
        if len(self.unlaunched) < count and self.prompts is not None:
            self._add_prompts(self.prompts(count - len(self.unlaunched)))
        take = min(count, len(self.unlaunched))
        return concat_groups([self.unlaunched.popleft() for _ in range(take)]) if take else None

    def _add_prompts(self, batch: Batch) -> None:
        self.unlaunched.extend(self._split(batch))

    def refill(self, trained_at: int | None = None) -> None:
        """With the rollout devices idle: the newest weights, then chunks up to the queue's bound (with partial
        rollouts the paused responses first, in the first chunk; `trained_at`: the earliest version a group
        this round finishes is trained at, which decides the paused responses too stale to continue)."""
        room = self.capacity - len(self.queue) - self._groups_in_flight()
        paused = list(self.partial.open) if self.partial is not None else []
        if self.in_flight or (room <= 0 and not paused):
            return
        self.rollout.sync_weights(self.version, self.stats)
        if self.partial is not None:
            self.partial.restart_stale(self.version if trained_at is None else trained_at, self.max_staleness)
        # with partial rollouts a round is one call: every call of it stops within the budget and the next
        # iteration collects the whole round anyway, so chunks would only decode one after another
        chunk = self.chunk_prompts if self.partial is None else max(room, 1)
        while room > 0 or paused:
            prompts = self._next_prompts(min(chunk, room)) if room > 0 else None
            if prompts is None and not paused:
                return
            if self.partial is not None:
                fresh = [OpenGroup.new(g) for g in self._split(prompts)] if prompts is not None else []
                self.partial.open.extend(fresh)
                prompts, paused = self.partial.launch(paused + fresh), []
            self.in_flight.append(self.rollout.launch(prompts, self.iteration, sample_round=self.launched))
            self.launched += 1
            room -= len(fresh) if self.partial is not None else len(prompts) // self.group_size

    def _split(self, batch: Batch) -> list[Batch]:
        n = self.group_size
        return [batch[i:i + n] for i in range(0, len(batch), n)]

    def _collect_next(self, serves: int | None = None) -> None:
        """The oldest chunk's rollouts into the queue (with partial rollouts: the groups it finished); `serves`:
        the iteration its ops belong to in the Timeline (default: this one, whose batch it serves)."""
        chunk = self.in_flight.popleft()
        chunk.iteration = self.iteration if serves is None else serves
        out = self.rollout.collect(chunk)
        if self.partial is None:
            self.queue.put(out)
            return
        for group in self.partial.absorb(out):
            self.queue.put(group)
        # the stalest groups train first (stable: generation order among equals), so a group that was
        # continued for several rounds does not wait behind the newer ones it outlasted
        self.queue.groups = deque(sorted(self.queue.groups, key=lambda g: int(g["policy_version"].min())))

    def generate(self, batch: Batch, greedy: bool = False, sample_round: int = 0) -> Batch:
        """As many groups from the queue as `batch` has prompts; `batch`'s prompts join the queue's end."""
        if greedy:  # refused in pipelined modes (check_runnable); synchronous if called directly
            return self.generate_now(batch, greedy, sample_round)
        self._add_prompts(batch)
        want = len(batch) // self.group_size
        taken: list[Batch] = []
        dropped = 0
        while self.partial is not None and self.in_flight:  # the last round, whole: its paused responses go on now
            self._collect_next()
        while len(taken) < want:
            got, lost = self.queue.take(want - len(taken), self.version)
            taken, dropped = taken + got, dropped + lost
            if len(taken) < want:
                self.refill()  # no-op while chunks are in flight
                if not self.in_flight:
                    raise HflowError(f"async mode: {len(taken)} of {want} prompt groups and no more prompts; give "
                                     "the dataflow a prompt source (`prompts`)")
                self._collect_next()
        self.refill(trained_at=self.version + 1)  # the rollout runs on while this batch trains (for the next)
        if self.partial is not None:  # a refill that launched nothing (the queue full) leaves it on its way
            self.rollout.finish_handover(self.stats)
        self.stats.update({"async/queue_groups": float(len(self.queue)),
                           "async/in_flight_groups": float(self._groups_in_flight()),
                           "async/dropped_groups": self.stats.get("async/dropped_groups", 0.0) + dropped})
        out = concat_groups(taken)
        if self.partial is not None:
            self.stats.update(partial_stats(out, self.version, self.partial))
        return out
