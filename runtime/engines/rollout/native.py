"""The `native` rollout backend: our own decoder, tp-sharded, generating with the KV-cache engine of
generation.py.

- On the trainer's devices it is the 3D-HybridEngine (hybrid.py): the generation weights are resharded
  from the training layout after every actor update.
- On rollout devices of its own (`NativeRollout`) the model is loaded from the actor's folder, sharded
  over the group's tp mesh by the family's tensor-parallel plan, and each weight sync's whole tensors are
  copied into this rank's slice (torch.chunk's split over tp, the plan's shard dimension).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hybridflow.runtime.engines.parallelize import apply_tp, tp_shard_dim
from hybridflow.runtime.engines.rollout.backends import ROLLOUT_ENGINES
from hybridflow.runtime.engines.rollout.base import RolloutEngine, RolloutSettings, weights_digest
from hybridflow.runtime.engines.rollout.generation import GenerationEngine, Rollout, SamplingParams
from hybridflow.runtime.engines.rollout.hybrid import HybridEngine
from hybridflow.runtime.engines.rollout.weight_sync import TensorSpec, tensor_specs
from hybridflow.runtime.engines.train.base import TrainEngine
from hybridflow.runtime.models.decoder import CausalLM
from hybridflow.runtime.models.hf_format import load_pretrained
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor (gathered over tp when it is a DTensor: a collective)."""
    return p.full_tensor() if isinstance(p, DTensor) else p.data


@ROLLOUT_ENGINES.register("native")
class NativeRollout(RolloutEngine):
    def __init__(self, model_path: str, *, mesh: DeviceMesh, device: torch.device):
        model = load_pretrained(model_path, head="lm").to(device)
        self.specs = tensor_specs(dict(model.named_parameters()))  # whole shapes: the sync's layout
        self.tp, self.tp_rank = mesh["tp"].size(), mesh["tp"].get_local_rank()
        self.dp_rank = mesh["dp"].get_local_rank()
        if self.tp > 1:
            apply_tp(model, mesh["tp"])
        self.model = model.eval()
        self.engine = GenerationEngine(self.model)

    @classmethod
    def on_trainer(cls, trainer: TrainEngine, model_path: str, settings: RolloutSettings, *,
                   seed: int) -> HybridEngine:
        layout = settings.generation or trainer.parallel
        world = trainer.parallel.world_size
        generation = ParallelConfig(tp=layout.tp, pp=layout.pp, dp=world // (layout.tp * layout.pp))
        return HybridEngine(trainer, CausalLM(trainer.decoder_config), generation, mode=settings.reshard)

    @classmethod
    def on_own_devices(cls, model_path: str, settings: RolloutSettings, *, mesh: DeviceMesh, device: torch.device,
                       seed: int) -> NativeRollout:
        return cls(model_path, mesh=mesh, device=device)

    def generate(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 lengths: torch.Tensor | None = None) -> Rollout:
        return self.engine.generate(prompt_ids, attention_mask, params, generator, lengths)

    def generation_ranks(self, rank: int) -> tuple[int, int]:
        return self.dp_rank, self.tp_rank

    def weight_specs(self) -> list[TensorSpec]:
        return self.specs

    @torch.no_grad()
    def load_weights(self, arrived: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = dict(self.model.named_parameters())
        received = 0
        for name, t in arrived:
            p = params[name]
            received += t.numel() * t.element_size()
            dim = tp_shard_dim(p)
            if dim is None:
                (p.to_local() if isinstance(p, DTensor) else p.data).copy_(t)
            else:  # Shard(dim) over the tp mesh: torch.chunk's split
                p.to_local().copy_(t.chunk(self.tp, dim)[self.tp_rank])
        return received

    def weights_digest(self) -> str:
        params = dict(self.model.named_parameters())
        return weights_digest({s.name: whole(params[s.name]) for s in self.specs})
