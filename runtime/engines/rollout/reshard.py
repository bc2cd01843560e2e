"""3D-HybridEngine: switch the actor's weights from the training layout to the generation layout.

Training layout (p, t, d): every device holds a 1/(t·p) model-parallel shard (tensor-parallel
pieces of its pipeline stage), replicated over d data-parallel replicas. Generation layout (p_g,
t_g) with t_g | t and p_g | p: every device holds a 1/(t_g·p_g) shard, and d_g = t·p/(t_g·p_g)
devices of a replica ("micro data-parallel group") hold the same one (paper §5, Fig. 8).

Three groupings, one code path (`Resharder`):

- "hybridflow": the generation tensor/pipeline ranks are taken at strides t/t_g and p/p_g over
  the training ranks, so the d_g training shards a generation shard is made of sit exactly on the
  d_g devices of one micro-DP group. One all-gather inside that group builds it; each device
  receives (d_g − 1)·M/(t·p) = (t·p − t_g·p_g)/(t_g·p_g·t·p)·M bytes, and its own training shard is
  a slice of its generation weights (`own_views`), so no device holds a redundant copy.
- "hybridflow-v" (vanilla): consecutive generation groups; a device's generation shard is not
  made of the shards around it, so it all-gathers the whole model inside its training
  model-parallel group ((t·p − 1)/(t·p)·M bytes, the full model M in memory) and slices.
- "ds-chat": the training weights are ZeRO-3 shards over all t·p·d devices; one all-gather over
  everyone ((t·p·d − 1)/(t·p·d)·M bytes, M in memory), then slice.

Back to training costs no communication: each device keeps its own slice (`to_training`).

M counts the tensor-parallel-sharded weights (everything but the norms and a scalar head): the
replicated parameters are already whole on every device and move in no mode at p = 1.

With pipeline stages (p > 1; generation is not pipelined here, so p_g = 1) a device holds only its
stage's shards, and a micro-DP group spans the stages: `to_generation_staged` packs each member's
stage shards into one flat buffer and all-gathers it inside the group (bytes (d_g − 1)·M/(t·p), the
Table 2 figure, when the stages hold equal shares of M — decoder stages do: the embedding on the
first, an equally sized LM head on the last). The few replicated parameters of a stage (its
norms) travel too, once per stage, counted apart (`replicated_bytes`). The flat buffer is a staging
copy of one generation shard while the switch runs; at p = 1 the gather lands in place.
`ReshardLayout` does the grouping and byte arithmetic for any (p, t) → (p_g, t_g).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.plan import IN_PLACE_RESHARDS

Mode = Literal["hybridflow", "hybridflow-v", "ds-chat"]


# ---- the grouping (pure index arithmetic) -------------------------------------------------------


@dataclass(frozen=True)
class ReshardLayout:
    """Training (p, t, d) → generation (p_g, t_g); world rank = (a·d + k)·t + i for pipeline
    stage a, data-parallel replica k and tensor rank i (the simulator's (pp, dp, tp) order)."""

    t: int
    t_g: int
    p: int = 1
    p_g: int = 1
    d: int = 1
    mode: str = "hybridflow"

    def __post_init__(self):
        if self.mode not in IN_PLACE_RESHARDS:
            raise HflowError(f"unknown reshard mode '{self.mode}'; use one of {', '.join(IN_PLACE_RESHARDS)}")
        if min(self.t, self.t_g, self.p, self.p_g, self.d) < 1 or self.t % self.t_g or self.p % self.p_g:
            raise HflowError(f"generation layout (p_g={self.p_g}, t_g={self.t_g}) must divide the training layout "
                             f"(p={self.p}, t={self.t}); pick t_g | t and p_g | p")

    @property
    def world(self) -> int:
        return self.p * self.t * self.d

    @property
    def d_g(self) -> int:
        """Micro data-parallel size: generation replicas inside one training replica."""
        return (self.t // self.t_g) * (self.p // self.p_g)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage a, data-parallel replica k, tensor rank i) of a world rank."""
        i = rank % self.t
        k = (rank // self.t) % self.d
        return rank // (self.t * self.d), k, i

    def rank(self, a: int, k: int, i: int) -> int:
        return (a * self.d + k) * self.t + i

    def generation_coords(self, rank: int) -> tuple[int, int, tuple[int, int]]:
        """(generation stage, generation tensor rank, micro-DP index) of a device."""
        a, _, i = self.coords(rank)
        st, ss = self.t // self.t_g, self.p // self.p_g
        if self.mode == "hybridflow":  # strided: gen shard j is made of training shards j·st … j·st+st−1
            return a // ss, i // st, (a % ss, i % st)
        return a % self.p_g, i % self.t_g, (a // self.p_g, i // self.t_g)  # consecutive groups

    def micro_dp_index(self, rank: int) -> int:
        """Position of a device in its micro-DP group's generation replicas (0 … d_g − 1)."""
        m_stage, m_tensor = self.generation_coords(rank)[2]
        return m_stage * (self.t // self.t_g) + m_tensor

    def generation_replica(self, rank: int) -> int:
        """The generation data-parallel replica of a device (0 … d·d_g − 1)."""
        return self.coords(rank)[1] * self.d_g + self.micro_dp_index(rank)

    def generation_tp_groups(self) -> list[list[int]]:
        """Every generation tensor-parallel group (ranks ordered by generation tensor rank)."""
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for r in range(self.world):
            a_g, j, m = self.generation_coords(r)
            groups.setdefault((self.coords(r)[1], a_g, m), []).append((j, r))
        return [[r for _, r in sorted(g)] for g in groups.values()]

    def gather_groups(self) -> list[list[int]]:
        """The groups each mode all-gathers in (ranks in the order their pieces concatenate)."""
        if self.mode == "ds-chat":
            return [list(range(self.world))]
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world):
            a, k, i = self.coords(r)
            key = (k, *self.generation_coords(r)[:2]) if self.mode == "hybridflow" else (k,)
            groups.setdefault(key, []).append(r)  # rank order = (stage, tensor) order of the pieces
        return list(groups.values())

    def formula_bytes(self, model_bytes: int) -> float:
        """Paper Table 2: bytes each device receives in the switch, for model bytes M."""
        tp = self.t * self.p
        if self.mode == "hybridflow":
            return (tp - self.t_g * self.p_g) / (self.t_g * self.p_g * tp) * model_bytes
        if self.mode == "hybridflow-v":
            return (tp - 1) / tp * model_bytes
        return (tp * self.d - 1) / (tp * self.d) * model_bytes

    def formula_peak_bytes(self, model_bytes: int) -> float:
        """Weights a device holds at the peak of the switch (HybridFlow: its generation shard only)."""
        return model_bytes / (self.t_g * self.p_g) if self.mode == "hybridflow" else float(model_bytes)


# ---- moving tensors -----------------------------------------------------------------------------


@dataclass
class ReshardStats:
    mode: str
    bytes_received: int = 0  # what the all-gathers delivered to this device from others
    peak_bytes: int = 0  # sharded weights alive on this device at the peak of the switch
    generation_bytes: int = 0  # the generation shard this device ends with
    collectives: int = 0
    dp_gather_bytes: int = 0  # HybridEngine: FSDP's all-gather over dp before the switch (not in Table 2)
    replicated_bytes: int = 0  # p > 1: the stages' replicated parameters (norms), not in M
    seconds: float = 0.0
    per_param: dict[str, int] = field(default_factory=dict)
    lora_adapter_bytes: int = 0  # HybridEngine under LoRA: the adapters this switch moved (after the first, all it moved)


class Resharder:
    """The switch for one training layout (p, t, d) → generation tensor size t_g (p_g = 1).

    Construct it on every rank of the default process group (it creates the gather groups
    collectively). `to_generation(shards, dims)` (p = 1) takes this rank's tensor-parallel training
    shards and the dimension each is split along (None: replicated) and returns its generation
    shards; `to_generation_staged` is the same for p > 1.
    """

    def __init__(self, t: int, t_g: int, d: int = 1, mode: str = "hybridflow", p: int = 1, p_g: int = 1):
        self.layout = ReshardLayout(t=t, t_g=t_g, p=p, p_g=p_g, d=d, mode=mode)
        if p_g != 1:
            raise HflowError(f"generation is not pipelined on this runtime (got p_g={p_g}); use a generation "
                             "layout with pp=1 (any pp in training)")
        if p > 1 and mode == "ds-chat":
            raise HflowError("the ds-chat reshard runs with pp=1 only (its ZeRO-3 slices ignore stages); "
                             "use mode 'hybridflow' or 'hybridflow-v' with pp > 1")
        if not dist.is_initialized() or dist.get_world_size() != self.layout.world:
            have = dist.get_world_size() if dist.is_initialized() else 0
            raise HflowError(f"reshard layout t={t}, d={d} needs a process group of {self.layout.world} ranks "
                             f"(have {have}); run it on every rank of the actor's group")
        self.rank = dist.get_rank()
        self.group, self.group_ranks = None, []
        for ranks in self.layout.gather_groups():  # every rank creates every group, in the same order
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                self.group, self.group_ranks = g, ranks
        _, self.gen_tp_rank, _ = self.layout.generation_coords(self.rank)
        self.own_views: dict[str, torch.Tensor] = {}

    # ---- meshes for the generation model ------------------------------------------------------
    def generation_mesh(self, device_type: str = "cpu"):
        """A ("dp", "micro_dp", "tp") DeviceMesh whose "tp" dim is this layout's generation TP groups."""
        from torch.distributed.device_mesh import DeviceMesh

        lay = self.layout
        grid = torch.empty(lay.d, lay.d_g, lay.t_g, dtype=torch.long)
        for r in range(lay.world):
            grid[lay.coords(r)[1], lay.micro_dp_index(r), lay.generation_coords(r)[1]] = r
        return DeviceMesh(device_type, grid, mesh_dim_names=("dp", "micro_dp", "tp"))

    # ---- the switch ---------------------------------------------------------------------------
    def _gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        outs = [torch.empty_like(piece) for _ in self.group_ranks]
        dist.all_gather(outs, piece.contiguous(), group=self.group)
        return outs

    @torch.no_grad()
    def to_generation(self, shards: Mapping[str, torch.Tensor], dims: Mapping[str, int | None],
                      out: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], ReshardStats]:
        """Training shards → generation shards (written into `out`'s tensors when given)."""
        lay, t, t_g = self.layout, self.layout.t, self.layout.t_g
        stats = ReshardStats(mode=lay.mode)
        n = len(self.group_ranks)
        gen: dict[str, torch.Tensor] = {}
        self.own_views = {}
        wholes: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # vanilla / DS-Chat: the full model
        start = time.perf_counter()
        for name, shard in shards.items():
            dim = dims[name]
            if dim is None:  # replicated: already whole here
                gen[name] = shard if out is None else out[name].copy_(shard)
                continue
            elem = shard.element_size()
            merged = list(shard.shape)
            merged[dim] = shard.shape[dim] * (t // t_g)
            target = out[name] if out is not None else shard.new_empty(merged)
            if list(target.shape) != merged:
                raise HflowError(f"generation parameter {name} has shape {list(target.shape)}, expected {merged}; "
                                 f"build the generation model with tp={t_g}")
            if lay.mode == "hybridflow":
                # The micro-DP group's pieces, in order, ARE the generation shard: gather straight
                # into its slices when they are contiguous (dim 0), else through one staging buffer.
                slots = list(target.chunk(n, dim))
                if n == 1:
                    slots[0].copy_(shard)
                elif dim == 0:
                    dist.all_gather(slots, shard.contiguous(), group=self.group)
                else:
                    for slot, piece in zip(slots, self._gather(shard), strict=True):
                        slot.copy_(piece)
                self.own_views[name] = slots[self.group_ranks.index(self.rank)]
                received = (n - 1) * shard.numel() * elem
            else:  # gather every whole parameter first (the redundant copy), slice afterwards
                piece = self._contribution(shard)
                wholes[name] = (self._assemble(self._gather(piece), shard, dim), target, dim)
                received = (n - 1) * piece.numel() * elem
            stats.bytes_received += received
            stats.per_param[name] = received
            stats.collectives += n > 1
            stats.generation_bytes += target.numel() * elem
            gen[name] = target
        full_bytes = sum(w.numel() * w.element_size() for w, _, _ in wholes.values())
        for whole, target, dim in wholes.values():
            size = target.shape[dim]
            target.copy_(whole.narrow(dim, self.gen_tp_rank * size, size))
        wholes.clear()
        stats.seconds = time.perf_counter() - start
        # HybridFlow holds only its generation shard (its training shard is a slice of it); the
        # others hold the whole model next to it until they have sliced.
        stats.peak_bytes = stats.generation_bytes + full_bytes
        return gen, stats

    def _contribution(self, shard: torch.Tensor) -> torch.Tensor:
        """What this device puts into the all-gather: its shard, or under DS-Chat its ZeRO-3
        1/d slice of it (flattened, padded to equal sizes)."""
        if self.layout.mode != "ds-chat" or self.layout.d == 1:
            return shard
        d = self.layout.d
        flat = shard.reshape(-1)
        per = -(-flat.numel() // d)
        flat = torch.nn.functional.pad(flat, (0, per * d - flat.numel()))
        _, k, _ = self.layout.coords(self.rank)
        return flat[k * per:(k + 1) * per]

    def _assemble(self, pieces: list[torch.Tensor], shard: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole parameter from the gathered pieces (gather-group order = rank order)."""
        lay = self.layout
        if lay.mode == "ds-chat" and lay.d > 1:  # pieces[(k·t + i)]: replica k's slice of tp shard i
            tp_shards = []
            for i in range(lay.t):
                flat = torch.cat([pieces[lay.rank(0, k, i)] for k in range(lay.d)])
                tp_shards.append(flat[:shard.numel()].view_as(shard))
            pieces = tp_shards
        return torch.cat(pieces, dim=dim)

    # ---- p > 1: the micro-DP group spans pipeline stages ----------------------------------------
    def _flat_gather(self, flat: torch.Tensor, size: int) -> list[torch.Tensor]:
        """All-gather one flat buffer per member, padded to `size` elements (the group's largest)."""
        flat = torch.nn.functional.pad(flat, (0, size - flat.numel()))
        return self._gather(flat) if len(self.group_ranks) > 1 else [flat]

    @torch.no_grad()
    def to_generation_staged(self, shards: Mapping[str, torch.Tensor], plan_dims: Mapping[str, int | None],
                             stages: Mapping[str, int], out: Mapping[str, torch.Tensor]) -> ReshardStats:
        """Training shards of this rank's pipeline stage → its generation shards of the whole model.

        `plan_dims`: for every parameter of the model, the dimension tensor parallelism splits it
        along (None: replicated), whatever t is; `stages`: the pipeline stage holding each parameter;
        `out`: the generation model's local tensors, written in place. Pieces travel in `out`'s order.
        """
        lay = self.layout
        stats = ReshardStats(mode=lay.mode)
        start = time.perf_counter()
        members = [(*lay.coords(r)[::2], r) for r in self.group_ranks]  # (stage, tensor rank, rank)
        first_of_stage = {}  # one holder sends each stage's replicated parameters
        for a, _, r in members:
            first_of_stage.setdefault(a, r)
        names = {a: [n for n in out if stages[n] == a] for a in set(stages.values())}
        elem = next(iter(out.values())).element_size()

        def piece_numel(name):
            return out[name].numel() * lay.t_g // (lay.t if plan_dims[name] is not None else 1)

        def sizes(a, r):  # elements member r of stage a sends: (split, replicated)
            split = sum(piece_numel(n) for n in names[a] if plan_dims[n] is not None)
            rep = sum(out[n].numel() for n in names[a] if plan_dims[n] is None) if first_of_stage[a] == r else 0
            return split, rep

        my_stage = lay.coords(self.rank)[0]
        split_flat = [shards[n].reshape(-1) for n in names[my_stage] if plan_dims[n] is not None]
        rep_flat = ([shards[n].reshape(-1) for n in names[my_stage] if plan_dims[n] is None]
                    if first_of_stage[my_stage] == self.rank else [])
        got = []
        for kind, flat in enumerate((split_flat, rep_flat)):
            size = max(sizes(a, r)[kind] for a, _, r in members)
            if size == 0:
                got.append(None)
                continue
            flat = torch.cat(flat) if flat else out[next(iter(out))].new_zeros(0)
            got.append(self._flat_gather(flat, size))
            received = (len(members) - 1) * size * elem
            if kind == 0:
                stats.bytes_received += received
            else:
                stats.replicated_bytes += received
            stats.collectives += len(members) > 1
        # Unpack: a generation shard is its pieces, in tensor-rank order, along the split dim (the
        # hybridflow group holds exactly those; the vanilla group holds all t and slices afterwards).
        self.own_views = {}
        for member, (a, i, r) in enumerate(members):
            offsets = [0, 0]
            for n in names[a]:
                dim = plan_dims[n]
                kind = 0 if dim is not None else 1
                if kind == 1 and first_of_stage[a] != r:
                    continue
                numel = piece_numel(n) if kind == 0 else out[n].numel()
                piece = got[kind][member][offsets[kind]:offsets[kind] + numel]
                offsets[kind] += numel
                if kind == 1:
                    out[n].copy_(piece.view_as(out[n]))
                    continue
                shape = list(out[n].shape)
                shape[dim] = shape[dim] * lay.t_g // lay.t
                held = [m for m in members if m[0] == a]  # this stage's tensor ranks in the group
                slot = [m[1] for m in held].index(i)
                whole_dim = shape[dim] * len(held)
                j = self.gen_tp_rank
                if whole_dim == out[n].shape[dim]:  # hybridflow: the pieces are the generation shard
                    target = out[n].narrow(dim, slot * shape[dim], shape[dim])
                else:  # vanilla: piece i of the whole parameter; keep it if inside this device's slice
                    lo, hi = j * out[n].shape[dim], (j + 1) * out[n].shape[dim]
                    pos = i * shape[dim]
                    if not lo <= pos < hi:
                        continue
                    target = out[n].narrow(dim, pos - lo, shape[dim])
                target.copy_(piece.view(shape))
                if r == self.rank:
                    self.own_views[n] = target
        got.clear()
        stats.generation_bytes = sum(t.numel() * t.element_size() for n, t in out.items() if plan_dims[n] is not None)
        stats.peak_bytes = stats.generation_bytes + (len(members) * max(sizes(a, r)[0] for a, _, r in members) * elem)
        stats.per_param = {n: piece_numel(n) * elem for n in out if plan_dims[n] is not None}
        stats.seconds = time.perf_counter() - start
        return stats

    @torch.no_grad()
    def to_training(self, gen: Mapping[str, torch.Tensor], dims: Mapping[str, int | None]) -> dict[str, torch.Tensor]:
        """Generation shards → this device's training shards: a local slice, no communication."""
        lay = self.layout
        out = {}
        for name, g in gen.items():
            dim = dims[name]
            if dim is None:
                out[name] = g.clone()
                continue
            size = g.shape[dim] // (lay.t // lay.t_g)
            _, _, i = lay.coords(self.rank)
            # Position of this device's training shard inside its generation shard.
            idx = i % (lay.t // lay.t_g) if lay.mode == "hybridflow" else None
            if idx is None:  # consecutive groups: the generation shard need not contain it
                raise HflowError(f"mode '{lay.mode}' does not keep the training shard inside the generation "
                                 "shard; keep the training weights (or use mode 'hybridflow')")
            out[name] = g.narrow(dim, idx * size, size).clone()
        return out
