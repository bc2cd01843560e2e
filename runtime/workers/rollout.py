"""RolloutWorker: the actor's generation on devices of its own (a plan's `generate_group`).

It holds only the generation layout: a whole (p_g = 1) copy of the policy, tensor-parallel over
t_g with d_g = world / t_g replicas (replica = rank // t_g), in the engine the actor's `rollout`
names, built by that backend's `on_own_devices` (engines/rollout/base.py) — no optimizer, no
training shards:
- `native` (engines/rollout/native.py): our generation model (tp-sharded with the tensor-parallel plan) and the KV-cache engine;
  each received tensor is copied into this rank's slice;
- `vllm`: VllmRollout (engines/rollout/vllm_rollout.py) in this process over this group's world (vLLM's
  SPMD mode: tensor-parallel groups of t_g consecutive ranks). It starts on dummy weights — the
  driver syncs before any rollout — and each sync's tensors go through VllmRollout.load_weights,
  the loader the hybrid engine's vLLM rollout uses, which keeps vLLM's own slice.
Its weights arrive from the actor's training group over the weight-sync group (weight_sync.py) after
each actor update; the driver runs both sides at once (rl/rollout.py).

Each rollout also returns `behaviour_log_probs`: the log-probs of the sampled tokens under the
weights that generated them (the behaviour policy), which an off-policy mode corrects for — from
the engine that sampled, log_softmax(logits / T) of the chosen token (vLLM: its `processed_logprobs`;
no second forward pass). Both engines give the same quantity without top-k/top-p; with them vLLM
renormalises over the kept tokens, so check_runnable refuses that combination off-policy.

`weights_digest` is exact: the native engine's parameters, gathered; for `vllm`, whose CPU backend
repacks its weights, the digest of the tensors handed to vLLM's loader at the last sync, kept only after
`record_digests(True)` (hashing the model on every sync is the tests' cost, not a run's).
"""

from __future__ import annotations

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.timing import timed, with_timing
from hybridflow.runtime.controller.worker import Worker
from hybridflow.runtime.engines.rollout.backends import ROLLOUT_ENGINES
from hybridflow.runtime.engines.rollout.base import RolloutSettings
from hybridflow.runtime.engines.rollout.generation import FORCED_LENGTH_FIELD
from hybridflow.runtime.engines.rollout.weight_sync import DEFAULT_BUCKET_BYTES, TensorSpec, WeightSyncGroup
from hybridflow.runtime.workers.common import generation_seed, rollout_fields
from hybridflow.simulator.errors import HflowError


class RolloutWorker(Worker):
    def __init__(self, model_path: str, *, rollout: RolloutSettings, seed: int = 0):
        super().__init__()
        if self.parallel.pp != 1:
            raise HflowError(f"rollout devices generate with pp = 1 (got {self.parallel}); use a generation layout "
                             "with pp=1")
        self.seed, self.sampling = seed, rollout.sampling
        self.sync: WeightSyncGroup | None = None
        self.version = 0  # the actor updates its weights have seen
        self.engine = ROLLOUT_ENGINES.get(rollout.backend).on_own_devices(model_path, rollout, mesh=self.mesh,
                                                                         device=self.device, seed=seed)

    # ---- weights ------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def weight_specs(self) -> list[TensorSpec]:
        return self.engine.weight_specs()

    @register("ONE_TO_ALL")
    def init_weight_sync(self, addr: str, port: int, world_size: int) -> None:
        self.sync = WeightSyncGroup(addr, port, 1 + self.rank, world_size)

    @register("ONE_TO_ALL")
    def receive_weights(self, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
        """The actor's whole weights, bucket by bucket; each rank keeps its tensor-parallel slice.
        Returns {"timing": {"weight_sync": [start, end, bytes received]}}."""
        timing: dict = {}
        with timed(timing, "weight_sync") as span, torch.no_grad():
            span[2] = float(self.engine.load_weights(self.sync.receive(self.engine.weight_specs(), bucket_bytes)))
        self.version = version
        return with_timing({}, timing)

    @register("ONE_TO_ALL")
    def record_digests(self, on: bool = True) -> None:
        """Keep what `weights_digest` needs from each following sync (vLLM: the digest of what it was handed)."""
        self.engine.record_digests(on)

    @register("ONE_TO_ALL")
    def weights_digest(self) -> str:
        return self.engine.weights_digest()

    # ---- rollout ------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def generation_ranks(self) -> tuple[int, int]:
        """(generation data-parallel replica, generation tensor rank) of this rank."""
        return self.engine.generation_ranks(self.rank)

    @register("ALL_TO_ALL")
    def generate(self, shard: Batch, iteration: int, greedy: bool = False, sample_round: int = 0) -> Batch:
        """Responses to this rank's prompt shard, as PolicyWorker.generate, plus per row the behaviour
        log-probs and `policy_version`, the actor updates the generating weights had seen."""
        timing: dict = {}
        replica, _ = self.generation_ranks()
        g = torch.Generator(device=self.device).manual_seed(generation_seed(self.seed, iteration, replica,
                                                                            sample_round))
        params = self.sampling.model_copy(update={"greedy": True}) if greedy else self.sampling
        with timed(timing, "generate_baseline" if greedy else "generate"):
            lengths = shard[FORCED_LENGTH_FIELD] if FORCED_LENGTH_FIELD in shard else None  # imposed lengths
            out = self.engine.generate(shard["prompt_ids"].to(self.device), shard["prompt_mask"].to(self.device),
                                       params, g, lengths)
        n = out.response.shape[0]
        return with_timing(Batch({**rollout_fields(out), "behaviour_log_probs": out.response_logprobs.float().cpu(),
                                  "policy_version": torch.full((n,), self.version, dtype=torch.long)}), timing)
