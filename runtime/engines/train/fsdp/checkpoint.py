"""The FSDP2 engine's sharded states in a checkpoint: model and optimizer with torch.distributed.checkpoint
(each rank writes its shards, in a local folder or at a URL through DCP's fsspec writer; the per-rank
step and RNG states beside them are the base's, engines/train/base.py), and the whole weights for an
HF export."""

from __future__ import annotations

import torch

from hybridflow.runtime.controller.locations import Location


class FsdpCheckpoint:
    """Mixed into FsdpEngine: needs `model`, `optimizer`, `pipeline` and `distributed`."""

    shards_folder = "dcp"

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

    def _save_shards(self, path: Location) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / self.shards_folder),
                 no_dist=not self.distributed)

    def _load_shards(self, path: Location) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_dict_options())
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / self.shards_folder), no_dist=not self.distributed)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._state_dict_options())
