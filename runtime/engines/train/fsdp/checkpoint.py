"""The FSDP2 engine's training checkpoints: model and optimizer with torch.distributed.checkpoint (each
rank writes its shards, in a local folder or at a URL through DCP's fsspec writer), the per-rank step and
RNG states (rank_state.py, as the Megatron engine keeps them), and the whole weights for an HF export."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.engines.train.rank_state import (
    check_checkpoint_folder,
    load_rank_state,
    save_rank_state,
)


class FsdpCheckpoint:
    """Mixed into TrainingEngine: needs `model`, `optimizer`, `pipeline`, `distributed` and `step`."""

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Whole (unsharded) fp32 weights on CPU, on every rank: for saving in HF format. A collective:
        call it on every rank. `rank0_only`: the other ranks get `{}` (cpu_offload gathers to rank 0 alone,
        so only one process holds a whole copy; pipeline stages are gathered on every rank regardless)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.distributed:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        if self.pipeline is not None:  # every stage's weights, gathered over pp
            return self.pipeline.full_state_dict()
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
        return {k: v.detach().cpu() for k, v in sd.items()}

    def _state_dict_options(self):
        """Pipeline stages hold different parameters: their optimizer param groups must be keyed by
        parameter name (flattened), not by list position, or DCP merges the stages' groups."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True) if self.pipeline is not None else None

    def _rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    def save(self, path: str | Path) -> Location:
        """Model + optimizer (torch.distributed.checkpoint, sharded) and per-rank step and RNG states, in a
        local folder or at a URL (DCP's fsspec writer then)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = Location(path)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"),
                 no_dist=not self.distributed)
        save_rank_state(path, self._rank(), self.step)
        if self.distributed:
            dist.barrier()
        return path

    def load(self, path: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Location(path)
        check_checkpoint_folder(path, self._rank(), "dcp", "TrainingEngine.save")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not self.distributed)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._state_dict_options())
        self.step = load_rank_state(path, self._rank())
