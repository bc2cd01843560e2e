"""What expert parallelism (a MoE model on Megatron with ep > 1, parallel.py) adds to an op's price: each
MoE layer's token exchanges over the ep ranks in training and forward passes; per optimizer step, the
experts' gradients reduced over fewer ranks than the dense weights'; and in the switch to generation,
which runs with every expert on each device (generation layouts have no ep), the gather of the other ep
ranks' experts. All are 0 / the ep = 1 terms when ep = 1, so a dense model or ep = 1 prices exactly as
without this module.

Routing is taken as balanced: each ep rank receives an ep-th of the routed tokens and runs its ep-th of
the experts on them, so the experts' FLOPs per device do not change with ep (cost.py prices them from
the active parameters as at ep = 1); skewed routing would make the busiest rank the critical path.
"""

from __future__ import annotations

from hybridflow.simulator.pricing.comm import Collectives, dp_ranks, ep_ranks, expert_dp_ranks
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.units import BF16


def expert_dispatch(cm: Collectives, model: ModelSpec, par: ParallelConfig, tokens: float,
                    alltoalls: int) -> tuple[float, float, float]:
    """(bandwidth seconds, latency seconds, bytes sent per device) of one micro-batch's token exchanges
    on one pipeline stage: per MoE layer `alltoalls` all-to-alls over the ep group (a dispatch and a
    combine per pass: 2 forward, 4 with the backward, 6 with recomputation — megatron-core's all-to-all
    dispatcher), each moving the device's `tokens` × top-k hidden vectors in bf16, of which it keeps an
    ep-th. Under tp > 1 every tensor rank holds (and exchanges) the micro-batch's tokens."""
    if par.ep <= 1 or model.experts is None:
        return 0.0, 0.0, 0.0
    size = BF16 * tokens * model.experts_per_token * model.hidden
    bw, lat = cm.alltoall(size, par.world_size, ep_ranks(par))
    n = alltoalls * model.layers / par.pp
    return n * bw, n * lat, n * (par.ep - 1) / par.ep * size


def megatron_expert_dp(cm: Collectives, model: ModelSpec, par: ParallelConfig,
                       n_params: float) -> tuple[float, float, float]:
    """Megatron's distributed optimizer under ep > 1, per optimizer step: (bandwidth seconds, latency
    seconds, bytes per device) of reduce-scattering the fp32 gradients and all-gathering the bf16 weights.
    The dense weights do so over dp as at ep = 1; the experts (an ep-th of them on each rank, the split
    memory.state_bytes holds) over the dp/ep ranks that hold the same experts."""
    experts = float(model.expert_params())
    dense_shard = BF16 * (n_params - experts) / (par.tp * par.pp)
    expert_shard = BF16 * experts / (par.tp * par.pp * par.ep)
    world, edp = par.world_size, par.dp // par.ep
    d_bw, d_lat = cm.allgather(dense_shard, world, dp_ranks(par))
    e_bw, e_lat = cm.allgather(expert_shard, world, expert_dp_ranks(par))
    nbytes = 3 * ((par.dp - 1) / par.dp * dense_shard + (edp - 1) / edp * expert_shard)
    return 3 * (d_bw + e_bw), 2 * (d_lat + e_lat), nbytes  # fp32 gradients: twice the bf16 bytes


def expert_gather(cm: Collectives, model: ModelSpec, train: ParallelConfig) -> tuple[float, float, float]:
    """(bandwidth seconds, latency seconds, bytes received per device) of gathering the other ep ranks'
    experts when the actor switches from training layout `train` to generation: an all-gather over the
    ep group of the experts (split as memory.state_bytes holds them), one collective per local expert
    weight (gate, up, down) of each of its stage's layers, as runtime/engines/train/megatron/shards.py gathers them."""
    if train.ep <= 1 or model.experts is None:
        return 0.0, 0.0, 0.0
    size = BF16 * model.expert_params() / (train.tp * train.pp)
    bw, lat = cm.allgather(size, train.world_size, ep_ranks(train))
    gathers = model.layers // train.pp * (model.experts // train.ep) * 3  # this stage's layers
    return bw, gathers * lat, (train.ep - 1) / train.ep * size
