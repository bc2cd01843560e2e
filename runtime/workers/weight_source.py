"""WeightSource: the actor's side of the weight sync to separate rollout devices (weight_sync.py).

Mixed into the PolicyWorker. Every rank of the actor's group takes part in gathering the whole
weights (a collective over its training layout); rank 0 alone is a member of the sync group and
broadcasts them to the rollout ranks.
"""

from __future__ import annotations

from hybridflow.runtime.controller.protocols import register
from hybridflow.runtime.controller.timing import timed, with_timing
from hybridflow.runtime.engines.rollout.base import weights_digest
from hybridflow.runtime.engines.rollout.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    TensorSpec,
    WeightSyncGroup,
    master_store,
)


class WeightSource:
    sync: WeightSyncGroup | None = None

    @register("ONE_TO_ALL")
    def open_weight_sync(self, world_size: int) -> tuple[str, int] | None:
        """Rank 0: open and hold the sync group's store; returns where the rollout ranks find it."""
        if self.rank != 0:
            return None
        import ray

        host = ray.util.get_node_ip_address()
        self.sync_store = master_store(host, world_size)
        return host, self.sync_store.port

    @register("ONE_TO_ALL")
    def init_weight_sync(self, addr: str, port: int, world_size: int) -> None:
        if self.rank == 0:
            self.sync = WeightSyncGroup(addr, port, 0, world_size, store=self.sync_store)

    @register("ONE_TO_ALL")
    def send_weights(self, specs: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
        """Broadcast the current weights (rank 0; the others only help gather them). Returns
        {"timing": {"weight_sync": [start, end, 0]}} (the bytes are counted where they arrive)."""
        timing: dict = {}
        with timed(timing, "weight_sync"):
            state = self.engine.full_state_dict(rank0_only=True)
            if self.sync is not None:
                self.sync.send(specs, state, bucket_bytes)
        return with_timing({}, timing)

    @register("ONE_TO_ALL")
    def weights_digest(self, specs: list[TensorSpec]) -> str:
        """sha256 of the whole current weights, in the rollout layout's names and dtypes."""
        state = self.engine.full_state_dict()
        return weights_digest({s.name: state[s.name].to(s.torch_dtype) for s in specs})
