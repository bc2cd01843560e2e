"""RolloutWorker: the actor's generation on devices of its own (a plan's `generate_group`).

It holds only the generation layout: a whole (p_g = 1) copy of the policy, tensor-parallel over
t_g with d_g = world / t_g replicas (replica = rank // t_g), in the engine the actor's `rollout`
names — no optimizer, no training shards:
- `native`: our generation model (tp-sharded with the tensor-parallel plan) and the KV-cache engine;
  each received tensor is copied into this rank's slice;
- `vllm`: VllmRollout (engines/vllm_rollout.py) in this process over this group's world (vLLM's
  SPMD mode: tensor-parallel groups of t_g consecutive ranks). It starts on dummy weights — the
  driver syncs before any rollout — and each sync's tensors go through VllmRollout.load_weights,
  the loader the hybrid engine's vLLM rollout uses, which keeps vLLM's own slice.
Its weights arrive from the actor's training group over the weight-sync group (weight_sync.py) after
each actor update; the driver runs both sides at once (disaggregated.py).

Each rollout also returns `behaviour_log_probs`: the log-probs of the sampled tokens under the
weights that generated them (the behaviour policy), which an off-policy mode corrects for — from
the engine that sampled, log_softmax(logits / T) of the chosen token (vLLM: its `processed_logprobs`;
no second forward pass). Both engines give the same quantity without top-k/top-p; with them vLLM
renormalises over the kept tokens, so check_runnable refuses that combination off-policy.

`weights_digest` is exact: the native engine's parameters, gathered. vLLM's CPU backend repacks its
linear weights into oneDNN's layout and drops the parameters, so for `vllm` it is the digest of the
tensors handed to vLLM's loader at the last sync, kept only after `record_digests(True)` (hashing the
model on every sync is the tests' cost, not a run's).
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.worker import Worker
from hybridflow.runtime.engines.parallelize import apply_tp, tp_shard_dim
from hybridflow.runtime.engines.rollout.generation import GenerationEngine, SamplingParams
from hybridflow.runtime.engines.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    TensorSpec,
    WeightSyncGroup,
    tensor_specs,
)
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.runtime.models.hf_format import read_config
from hybridflow.runtime.workers.common import (
    exact_bytes,
    generation_seed,
    load_causal_lm,
    rollout_fields,
    timed,
    with_timing,
)
from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import ROLLOUT_BACKENDS, RolloutBackend


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (gathered over tp when it is a DTensor: a collective)."""
    return p.full_tensor() if isinstance(p, DTensor) else p.data


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over names and exact bytes (the exactness check of a sync)."""
    h = hashlib.sha256()
    for name, t in named.items():
        h.update(name.encode())
        h.update(exact_bytes(t))
    return h.hexdigest()


class RolloutWorker(Worker):
    def __init__(self, model_path: str, *, sampling: SamplingParams | None = None, seed: int = 0,
                 backend: RolloutBackend = "native", prompt_len: int | None = None):
        """backend: the actor's rollout engine; prompt_len: the longest prompt (vLLM sizes its context
        to prompt_len + max_new_tokens)."""
        super().__init__()
        if self.parallel.pp != 1:
            raise HflowError(f"rollout devices generate with pp = 1 (got {self.parallel}); use a generation layout "
                             "with pp=1")
        self.seed, self.sampling, self.backend = seed, sampling or SamplingParams(), backend
        self.sync: WeightSyncGroup | None = None
        self.version = 0  # the actor updates its weights have seen
        self.digests = False  # vllm: hash what each sync hands to vLLM (record_digests)
        self.pushed_digest: str | None = None
        if backend == "vllm":  # imported here: vLLM is an optional extra
            from hybridflow.runtime.engines.rollout.vllm_rollout import VllmRollout

            cfg, _ = read_config(model_path)
            self.model = None
            # whole shapes and dtypes as the native worker loads them, without the weights
            self.specs = tensor_specs(dict(CausalLM.empty(cfg, "meta").named_parameters()))
            max_len = prompt_len + self.sampling.max_new_tokens if prompt_len else None
            self.engine = VllmRollout(model_path, tensor_parallel_size=self.parallel.tp, seed=seed,
                                      max_model_len=max_len, load_format="dummy")
        elif backend == "native":
            model = load_causal_lm(model_path).to(self.device)
            self.specs = tensor_specs(dict(model.named_parameters()))  # whole shapes: the sync's layout
            if self.parallel.tp > 1:
                apply_tp(model, self.mesh["tp"])
            self.model = model.eval()
            self.engine = GenerationEngine(self.model)
        else:
            raise HflowError(f"unknown rollout backend '{backend}'; choose one of {', '.join(ROLLOUT_BACKENDS)}")

    # ---- weights ------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def weight_specs(self) -> list[TensorSpec]:
        return self.specs

    @register("ONE_TO_ALL")
    def init_weight_sync(self, addr: str, port: int, world_size: int) -> None:
        self.sync = WeightSyncGroup(addr, port, 1 + self.rank, world_size)

    @register("ONE_TO_ALL")
    def receive_weights(self, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
        """The actor's whole weights, bucket by bucket; each rank keeps its tensor-parallel slice.
        Returns {"bytes": received, "timing": {"weight_sync": [start, end]}}."""
        timing: dict = {}
        pushed: dict[str, torch.Tensor] = {}
        with timed(timing, "weight_sync"), torch.no_grad():
            arrived = self.sync.receive(self.specs, bucket_bytes)
            if self.model is None:  # vllm: its loader fuses and slices (the same path as the actor's vLLM)
                pushed = dict(arrived)
                self.engine.load_weights(pushed)
                received = sum(t.numel() * t.element_size() for t in pushed.values())
            else:
                received = self._copy_into_model(arrived)
        if pushed and self.digests:  # outside the timed span: a check, not part of the sync
            self.pushed_digest = weights_digest(pushed)
        self.version = version
        return {"bytes": received, "timing": timing}

    def _copy_into_model(self, arrived) -> int:
        params = dict(self.model.named_parameters())
        received = 0
        for name, t in arrived:
            p = params[name]
            received += t.numel() * t.element_size()
            dim = tp_shard_dim(p)
            if dim is None:
                (p.to_local() if isinstance(p, DTensor) else p.data).copy_(t)
            else:  # Shard(dim) over the tp mesh: torch.chunk's split
                p.to_local().copy_(t.chunk(self.parallel.tp, dim)[self.coords[2]])
        return received

    @register("ONE_TO_ALL")
    def record_digests(self, on: bool = True) -> None:
        """vllm: keep the digest of the weights each following sync hands to vLLM (weights_digest)."""
        self.digests = on

    @register("ONE_TO_ALL")
    def weights_digest(self) -> str:
        if self.model is not None:
            params = dict(self.model.named_parameters())
            return weights_digest({s.name: whole(params[s.name]) for s in self.specs})
        if self.pushed_digest is None:
            raise HflowError("no weights digest recorded on this vLLM rollout worker; call record_digests(True) "
                             "before the sync")
        return self.pushed_digest

    # ---- rollout ------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def generation_ranks(self) -> tuple[int, int]:
        """(generation data-parallel replica, generation tensor rank) of this rank."""
        _, dp, tp = self.coords  # dp = rank // t_g: vLLM's replicas too
        return dp, tp

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
            out = self.engine.generate(shard["prompt_ids"].to(self.device), shard["prompt_mask"].to(self.device),
                                       params, g)
        n = out.response.shape[0]
        return with_timing(Batch({**rollout_fields(out), "behaviour_log_probs": out.response_logprobs.float().cpu(),
                                  "policy_version": torch.full((n,), self.version, dtype=torch.long)}), timing)
