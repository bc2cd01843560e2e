"""The Megatron engine's sharded states in a checkpoint: model and distributed optimizer with megatron's
dist_checkpointing (each rank writes its shards; a load reads them into this layout). The per-rank step
and RNG states beside them are the base's (engines/train/base.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.engines.train.megatron.cpu_shim import megatron_on_cpu


class MegatronCheckpoint:
    """Mixed into MegatronEngine: needs `module` and `optimizer`."""

    shards_folder = "dist"

    def _sharded_state(self, loading: bool = False):
        # "dp_reshardable": the optimizer states as the dp buckets hold them (torch Adam keeps "step" there).
        if loading:  # the load fills optimizer states in place: a fresh optimizer must have them
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if not opt.optimizer.state:
                    opt._init_optimizer_states_with_dummy_values()
        model_sd = self.module.sharded_state_dict()
        optim_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                     metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        return {"model": model_sd, "optim": optim_sd}

    def _save_shards(self, path: Location) -> None:
        """Model + distributed optimizer with megatron's dist_checkpointing (a local folder)."""
        from megatron.core import dist_checkpointing

        folder = Path(str(path / self.shards_folder))
        folder.mkdir(parents=True, exist_ok=True)
        with megatron_on_cpu():
            dist_checkpointing.save(self._sharded_state(), str(folder))

    def _load_shards(self, path: Location) -> None:
        from megatron.core import dist_checkpointing

        with megatron_on_cpu(), torch.no_grad():  # states are copied into leaf parameters in place
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(path / self.shards_folder))
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
