"""The Megatron engine's training checkpoints: model and distributed optimizer with megatron's
dist_checkpointing (each rank writes its shards; a load reads them into this layout), plus the
per-rank step and RNG states (rank_state.py, as the FSDP2 engine keeps them)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.runtime.engines.train.megatron.cpu_shim import megatron_on_cpu
from hybridflow.runtime.engines.train.rank_state import (
    check_checkpoint_folder,
    load_rank_state,
    save_rank_state,
)


class MegatronCheckpoint:
    """Mixed into MegatronEngine: needs `module`, `optimizer` and `step`."""

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

    def save(self, path: str | Path) -> Path:
        """Model + distributed optimizer with megatron's dist_checkpointing, and per-rank step and RNG."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / "dist").mkdir(parents=True, exist_ok=True)
        with megatron_on_cpu():
            dist_checkpointing.save(self._sharded_state(), str(path / "dist"))
        save_rank_state(path, dist.get_rank(), self.step)
        dist.barrier()
        return path

    def load(self, path: str | Path) -> None:
        from megatron.core import dist_checkpointing

        path = Path(path)
        check_checkpoint_folder(path, dist.get_rank(), "dist", "MegatronEngine.save")
        with megatron_on_cpu(), torch.no_grad():  # states are copied into leaf parameters in place
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(path / "dist"))
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        self.step = load_rank_state(path, dist.get_rank())
