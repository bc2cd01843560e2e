"""RolloutWorker: the actor's generation on devices of its own (a plan's `generate_group`).

It holds only the generation layout: a whole (p_g = 1) copy of the policy, tensor-parallel over
t_g with d_g = world / t_g replicas, in the native KV-cache engine — no optimizer, no training
shards. Its weights arrive from the actor's training group over the weight-sync group
(weight_sync.py) after each actor update; the driver runs both sides at once (disaggregated.py).

Each rollout also returns `behaviour_log_probs`: the log-probs of the sampled tokens under the
weights that generated them (the behaviour policy), which an off-policy mode corrects for.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor

from hybridflow.runtime.batch import Batch
from hybridflow.runtime.engines.generation import GenerationEngine, SamplingParams
from hybridflow.runtime.engines.parallelize import apply_tp, tp_shard_dim
from hybridflow.runtime.protocols import register
from hybridflow.runtime.weight_sync import DEFAULT_BUCKET_BYTES, TensorSpec, WeightSyncGroup, tensor_specs
from hybridflow.runtime.worker import Worker
from hybridflow.simulator.errors import HflowError

from .common import generation_seed, load_causal_lm, rollout_fields, timed, with_timing


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (gathered over tp when it is a DTensor: a collective)."""
    return p.full_tensor() if isinstance(p, DTensor) else p.data


def weights_digest(named: dict[str, torch.Tensor]) -> str:
    """sha256 over names and exact bytes (the exactness check of a sync)."""
    h = hashlib.sha256()
    for name, t in named.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RolloutWorker(Worker):
    def __init__(self, model_path: str, *, sampling: SamplingParams | None = None, seed: int = 0):
        super().__init__()
        if self.parallel.pp != 1:
            raise HflowError(f"rollout devices generate with pp = 1 (got {self.parallel}); use a generation layout "
                             "with pp=1")
        self.seed, self.sampling = seed, sampling or SamplingParams()
        model = load_causal_lm(model_path).to(self.device)
        self.specs = tensor_specs(dict(model.named_parameters()))  # whole shapes: the sync's layout
        if self.parallel.tp > 1:
            apply_tp(model, self.mesh["tp"])
        self.model = model.eval()
        self.engine = GenerationEngine(self.model)
        self.sync: WeightSyncGroup | None = None
        self.version = 0  # the actor updates its weights have seen

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
        params = dict(self.model.named_parameters())
        received = 0
        with timed(timing, "weight_sync"), torch.no_grad():
            for name, t in self.sync.receive(self.specs, bucket_bytes):
                p = params[name]
                received += t.numel() * t.element_size()
                dim = tp_shard_dim(p)
                if dim is None:
                    (p.to_local() if isinstance(p, DTensor) else p.data).copy_(t)
                else:  # Shard(dim) over the tp mesh: torch.chunk's split
                    p.to_local().copy_(t.chunk(self.parallel.tp, dim)[self.coords[2]])
        self.version = version
        return {"bytes": received, "timing": timing}

    @register("ONE_TO_ALL")
    def weights_digest(self) -> str:
        params = dict(self.model.named_parameters())
        return weights_digest({s.name: whole(params[s.name]) for s in self.specs})

    # ---- rollout ------------------------------------------------------------------------------
    @register("ONE_TO_ALL")
    def generation_ranks(self) -> tuple[int, int]:
        """(generation data-parallel replica, generation tensor rank) of this rank."""
        _, dp, tp = self.coords
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
