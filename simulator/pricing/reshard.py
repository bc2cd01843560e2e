"""Weight resharding from the actor's training layout to its generation layout (paper §5.4, Table 2).

M is the actor's weight bytes; the training layout is p-t-d (pipeline, tensor, data); the
generation layout has model-parallel size t_g·p_g. In Table 2 "tp" is the product t·p.

  mode          what moves                                              volume per device        peak memory
  ds-chat       all-gather of the whole model over all t·p·d devices   (tpd-1)/(tpd)·M          M
  hybridflow-v  all-gather of the whole model over each t·p replica    (tp-1)/(tp)·M            M
  hybridflow    all-gather inside each micro-DP group of t·p/(t_g·p_g)
                devices, each gathering its generation shard M/(t_g·p_g) (tp-t_g·p_g)/(t_g·p_g·tp)·M  M/(t_g·p_g)
  broadcast     the full model from the training to separate generation
                devices every iteration (OpenRLHF)                      M                        M/(t_g·p_g)

Redundancy (weights held twice on one device): DS-Chat M/(tpd), HybridFlow-V M/(tp), HybridFlow 0.
The HybridFlow micro-DP group is consecutive in the training layout (the generation TP group is
strided) so that each device's training shard lies inside its generation shard: zero redundancy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.execution import WEIGHT_SYNC_BUCKET_BYTES
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import RESHARD_MODES

# The weight sync to separate rollout devices packs the model into flat buffers of at most
# WEIGHT_SYNC_BUCKET_BYTES and broadcasts each (runtime/engines/rollout/weight_sync.py): one collective,
# one link latency, per bucket.


# Generation under ZeRO-3 without a hybrid engine (HF generate; DS-Chat with the Hybrid Engine off): no
# switch at all, the generation op gathers each layer's shards every pass (CostModel.generate's
# gather_every_step). Not a mode a plan names: Plan.weight_sync_mode() answers it for such mechanics.
IN_PLACE = "in-place"
# DeepSpeed-Chat's Hybrid Engine: Table 2's ds-chat gather, each device then keeping only its slice of the
# inference containers' tensor parallelism (--inference_tp_size), so the peak is M/t_g, not M.
HYBRID_ENGINE = "hybrid-engine"


def weight_sync_buckets(model_bytes: float, bucket_bytes: int = WEIGHT_SYNC_BUCKET_BYTES) -> int:
    """Broadcasts one weight sync makes (a tensor larger than a bucket goes alone: about the bytes over
    the bucket size)."""
    return max(1, math.ceil(model_bytes / bucket_bytes))


class ReshardSpec(NamedTuple):
    volume: float  # bytes each device receives
    peak_memory: float  # generation-weight bytes per device at the peak of the transition
    redundancy: float  # bytes per device held twice (training shard + generation copy)
    gathered_bytes: float  # size of what one collective gathers (the ring's S)
    ranks: tuple[int, ...]  # first instance of the gathering group, as training ranks


def reshard_spec(model_bytes: float, train: ParallelConfig, gen: ParallelConfig, mode: str) -> ReshardSpec:
    M = float(model_bytes)
    t, p, d = train.tp, train.pp, train.dp
    tp = t * p
    if mode == "ds-chat":
        n = tp * d
        return ReshardSpec((n - 1) / n * M, M, M / n, M, tuple(range(n)))
    if mode == "hybridflow-v":
        ranks = tuple(k * t * d + j for k in range(p) for j in range(t))
        return ReshardSpec((tp - 1) / tp * M, M, M / tp, M, ranks)
    if mode == "hybridflow":
        if t % gen.tp or p % gen.pp:
            raise HflowError(f"hybridflow resharding needs generation tp={gen.tp} | training tp={t} and "
                             f"generation pp={gen.pp} | training pp={p}; pick divisors of the training layout")
        mp_g = gen.tp * gen.pp
        # micro-DP group: t/t_g consecutive tensor ranks × p/p_g consecutive pipeline stages
        ranks = tuple(k * t * d + j for k in range(p // gen.pp) for j in range(t // gen.tp))
        return ReshardSpec((tp - mp_g) / (mp_g * tp) * M, M / mp_g, 0.0, M / mp_g, ranks)
    if mode == "broadcast":
        mp_g = gen.tp * gen.pp
        return ReshardSpec(M, M / mp_g, M / mp_g, M, (0,))
    if mode == HYBRID_ENGINE:  # DS-Chat: every device gathers the whole model, keeping its inference-TP slice
        n, mp_g = tp * d, gen.tp * gen.pp
        return ReshardSpec((n - 1) / n * M, M / mp_g, M / n, M, tuple(range(n)))
    if mode == IN_PLACE:  # generation reads the ZeRO-3 shards where they are, gathering a layer at a time
        return ReshardSpec(0.0, 0.0, 0.0, 0.0, (0,))  # (a layer's gather buffer, as a forward's: negligible)
    raise HflowError(f"unknown reshard mode '{mode}'; known modes: {', '.join((*RESHARD_MODES, HYBRID_ENGINE, IN_PLACE))}")


def reshard_volume(model_bytes: float, train: ParallelConfig, gen: ParallelConfig, mode: str) -> float:
    """Bytes each device receives when switching the actor from `train` to `gen` (paper Table 2)."""
    return reshard_spec(model_bytes, train, gen, mode).volume


def reshard_peak_memory(model_bytes: float, train: ParallelConfig, gen: ParallelConfig, mode: str) -> float:
    """Generation-weight bytes per device at the transition's peak (paper Table 2)."""
    return reshard_spec(model_bytes, train, gen, mode).peak_memory
