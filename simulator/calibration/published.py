"""Published GPU measurements (profiles/published.yaml, docs/published.md) and how the simulator prices them.

No GPU is at hand, so figures others measured on real clusters are the simulator's ground truth. Each
record says what its source really says — title, section or table, where it can be read, the quoted
row or sentence, the hardware, model, layout, engine settings and workload, the figure, its unit and
what it measures — and, when the simulator can express it, a `setup`: the same run in this
simulator's vocabulary, and the `metric` that turns the simulator's seconds into the source's unit.
Records the simulator cannot express keep `setup: null` and say why (`reason`).

Two tiers. *op*: one engine doing one thing — generation (vLLM, TensorRT-LLM, SGLang), training
(FSDP, Megatron), a collective (nccl-tests), a weight sync into a serving engine; the efficiency terms are fitted to these.
*system*: whole RLHF iterations, their phases, and the speedups papers state between systems; they
validate the fitted terms (tools/bench/published.py prices them on the systems' own mechanics).

    points = load_published()                       # every record, validated
    predicted = price_op(points[0].setup)           # in the record's unit, on the analytic defaults
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.pricing.cost import CostModel
from hybridflow.simulator.pricing.efficiency import EfficiencyParams, engine_params
from hybridflow.simulator.pricing.generation import prefill
from hybridflow.simulator.vocabulary.hardware import ClusterSpec, hardware_preset
from hybridflow.simulator.vocabulary.model import ModelSpec, model_preset
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import AlgorithmName
from hybridflow.simulator.vocabulary.workload import Workload

_RECORD = ConfigDict(extra="forbid", frozen=True)
UNLIMITED = 1e18  # free bytes where a source fixes the batch itself (a static batch)


def dataset_path() -> Path:
    # profiles/ sits beside simulator/ in the source tree and in the installed package alike
    return Path(__file__).resolve().parents[2] / "profiles" / "published.yaml"


# ---- what a source says ------------------------------------------------------------------------------
class Source(BaseModel):
    model_config = _RECORD

    title: str
    where: str
    url: str
    quote: str


class Measured(BaseModel):
    model_config = _RECORD

    value: float
    unit: str
    what: str


# ---- how the simulator expresses it ------------------------------------------------------------------
def _model(ref: str | dict) -> ModelSpec:
    return model_preset(ref) if isinstance(ref, str) else ModelSpec.model_validate(ref)


class _Setup(BaseModel):
    model_config = _RECORD

    hardware: str  # a preset (simulator/vocabulary/hardware.py)
    nodes: PositiveInt = 1
    devices_per_node: PositiveInt = 8
    assumed: str = ""  # what the source leaves unsaid and this setup assumes
    unit_scale: float = 1.0  # the measured value × this = the metric in SI units (ms: 0.001, GB/s: 1e9)
    hardware_overrides: dict[str, float] = Field(default_factory=dict)  # where the source's machine differs

    @field_validator("hardware")
    @classmethod
    def _known(cls, name: str) -> str:
        return hardware_preset(name).name

    def cluster(self) -> ClusterSpec:
        hw = hardware_preset(self.hardware).model_copy(update=self.hardware_overrides)
        return ClusterSpec(hardware=hw, nodes=self.nodes, devices_per_node=self.devices_per_node)


class GenerateSetup(_Setup):
    """`requests` sequences of `prompt_len` + `response_len` tokens on one tp group, `batch` at a time (a
    static batch, or a server's concurrency: what max_num_seqs and the KV cache allow)."""

    op: Literal["generate"]
    engine: Literal["vllm", "tensorrt-llm", "sglang"]
    # the engine's release as the source states it (vLLM: required; before 0.6 its host work is not overlapped,
    # efficiency.engine_params)
    engine_version: str | None = None
    model: str | dict
    tp: PositiveInt = 1
    batch: PositiveInt | None = None  # None: as many as the engine's batch limit and the KV cache hold
    requests: PositiveInt
    prompt_len: PositiveInt
    response_len: PositiveInt
    max_num_seqs: PositiveInt | None = None  # the engine's batch limit where the source sets it
    memory_fraction: float | None = Field(None, gt=0, le=1)  # the engine's share of device memory
    metric: Literal["output_tokens_per_s", "output_tokens_per_s_per_gpu", "request_seconds", "ttft_seconds",
                    "tpot_seconds", "batching_gain", "host_seconds_per_step"]
    gain_batch: PositiveInt | None = None  # batching_gain: throughput at gain_batch over throughput at batch

    @field_validator("engine_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        if v is not None and not all(p.isdigit() for p in v.split(".")[:2]):
            raise ValueError(f"engine_version {v!r}: give the release as digits, e.g. 0.3.1")
        return v

    def model_post_init(self, _) -> None:
        if self.engine == "vllm" and self.engine_version is None:
            raise ValueError("a vLLM setup names its engine_version (the release the source ran)")


class TrainSetup(_Setup):
    """Training steps of `global_batch` sequences of `seq_len` tokens, `micro_batch` per device at a time."""

    op: Literal["train"]
    model: str | dict
    parallel: ParallelConfig
    seq_len: PositiveInt
    micro_batch: PositiveInt
    global_batch: PositiveInt
    recompute: bool = False  # full activation recomputation (selective recomputation is priced as none)
    metric: Literal["tokens_per_s_per_gpu"]


class CollectiveSetup(_Setup):
    """One collective of `size_bytes` over `gpus` devices (consecutive, `devices_per_node` to a node)."""

    op: Literal["allreduce", "allgather"]
    gpus: PositiveInt
    size_bytes: float
    metric: Literal["busbw", "seconds"]


class WeightSyncSetup(_Setup):
    """One weight sync from `trainer_gpus` sharded (FSDP / ZeRO-3) training devices to `sampler_gpus` serving devices
    of tensor parallelism `tp`: gathered on the trainer, broadcast in buckets, loaded into every engine."""

    op: Literal["weight_sync"]
    model: str | dict
    trainer_gpus: PositiveInt
    sampler_gpus: PositiveInt
    tp: PositiveInt = 1
    metric: Literal["seconds"]


# ---- the system tier: whole runs, and the ratios a paper states over its grid ------------------------
SystemName = Literal["hybridflow", "deepspeed-chat", "openrlhf", "openrlhf-colocated", "nemo-aligner", "nemo-rl"]


class SystemRunSetup(_Setup):
    """One system's run of `workload` on the cluster, priced on that system's mechanics (planner/baselines.py;
    nemo-rl and hybridflow on this simulator's own, in the layout `settings` states). `iterations`: how many
    iterations the measured figure covers (a whole run's hours)."""

    op: Literal["system_run"]
    system: SystemName
    algorithm: AlgorithmName
    models: dict[str, str | dict]
    workload: dict
    settings: dict = Field(default_factory=dict)  # the system's own knobs (planner/published_systems.py reads them)
    vllm_version: str | None = None  # the vLLM it generated with (None: no vLLM); efficiency.engine_params
    iterations: float = Field(1.0, gt=0)
    # a whole run over `samples` prompts, in iterations of the workload's prompts — or, with the setting
    # `largest_batch`, of the largest batch per device that fits (at most the workload's), as DS-Chat's
    # benchmark ran ("the largest training batch size that does not result in an out-of-memory error")
    samples: PositiveInt | None = None
    # what the system's own timers span: `system` — generation with its scoring forwards, then training, the
    # iteration from first op to last; `deepspeed-chat` — DS-Chat step 3's main.py: its generate() calls alone
    # (the last call's time × generation_batches) and its training loop, summed as the iteration ("we did not
    # include, e.g., rw forward time etc"): the scoring forwards are in neither
    timer: Literal["system", "deepspeed-chat"] = "system"
    metric: Literal["iteration_seconds", "generation_seconds", "training_seconds", "run_seconds"]


class PaperStudySetup(_Setup):
    """A ratio the HybridFlow paper states over its §8 grid (planner/published_systems.py prices each study):
    HybridFlow's searched plan against a baseline's, per cell of `grid` (model -> GPU counts; a count where a
    system does not fit is left out, as the paper's figures start at the smallest count that runs)."""

    op: Literal["paper_study"]
    study: Literal["speedup", "generation_share", "transition_reduction", "generation_tp_reduction",
                   "colocate_gain", "strong_scaling"]
    algorithms: list[AlgorithmName]
    baselines: list[str] = Field(default_factory=list)
    statistic: Literal["mean", "max", "min", "one"] = "mean"
    grid: dict[str, list[PositiveInt]] = Field(default_factory=dict)
    workload: dict = Field(default_factory=dict)
    critic_model: str | None = None  # colocate_gain: the critic and reward's model (the actor's is the grid's)
    generation_tp: tuple[PositiveInt, PositiveInt] | None = None  # generation_tp_reduction: t_g, against t_g
    train: ParallelConfig | None = None  # generation_tp_reduction: every model's training layout
    # generation_tp_reduction: the share of the memory free once every model is loaded that the engine's KV cache
    # takes (verl's vLLM fork's gpu_memory_utilization: free memory × it; upstream vLLM's is of the whole device)
    kv_share_of_free_memory: float | None = Field(None, gt=0, le=1)
    # the vLLM HybridFlow and OpenRLHF generated with in the paper (DS-Chat and NeMo-Aligner have their own loops)
    vllm_version: str | None = None
    metric: Literal["ratio", "percent"]


Setup = Annotated[GenerateSetup | TrainSetup | CollectiveSetup | WeightSyncSetup | SystemRunSetup | PaperStudySetup,
                  Field(discriminator="op")]


class PublishedPoint(BaseModel):
    model_config = _RECORD

    id: str
    tier: Literal["op", "system"]
    kind: str
    phase: str | None = None
    source: Source
    hardware: dict
    system: str | None = None
    algorithm: str | None = None
    model: dict | None = None
    models: dict | None = None
    settings: dict
    workload: dict
    measured: Measured
    expressible: bool
    reason: str = ""
    setup: Setup | None = None


@lru_cache(maxsize=2)
def _load(path: str) -> tuple[PublishedPoint, ...]:
    try:
        # libyaml's loader where PyYAML was built with it: the same records, several times faster to parse
        records = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as e:
        raise HflowError(f"{path}: cannot read the published dataset ({e.strerror})") from None
    return tuple(PublishedPoint.model_validate(r) for r in records)


def load_published(path: str | Path | None = None) -> tuple[PublishedPoint, ...]:
    """Every record of the dataset, validated (a malformed record is a pydantic error naming it)."""
    return _load(str(path or dataset_path()))


# ---- pricing an op-tier setup ----------------------------------------------------------------------
ModelFor = Callable[..., CostModel]  # (cluster, **EfficiencyParams updates) -> the cost model pricing it


def analytic(cluster: ClusterSpec, **param_updates) -> CostModel:
    """The analytic cost model on `cluster` with its hardware's default terms (and `param_updates`)."""
    return CostModel(cluster, EfficiencyParams.for_hardware(cluster.hardware, **param_updates))


def price_generate(s: GenerateSetup, model_for: ModelFor) -> float:
    model = _model(s.model)
    gen = ParallelConfig(tp=s.tp)
    engine = {k: v for k, v in (("max_decode_batch", s.max_num_seqs), ("usable_memory_fraction", s.memory_fraction))
              if v is not None}
    engine.update(engine_params(s.engine, s.engine_version))

    def run(batch: int | None):
        updates, free = dict(engine), None
        if batch is not None:  # a static batch: exactly `batch` at a time
            updates["max_decode_batch"], free = batch, UNLIMITED
        c = model_for(s.cluster(), **updates)
        w = Workload(prompts=s.requests, prompt_len=s.prompt_len, response_len=s.response_len)
        return c, c.generate(model, gen, w, sequences=s.requests, free_bytes_per_device=free)

    if s.metric == "host_seconds_per_step":
        c = model_for(s.cluster(), **engine)
        return c.host_seconds_per_step(s.batch)
    if s.metric == "ttft_seconds":
        c = model_for(s.cluster())
        return sum(prefill(c, model, gen, s.batch or 1, s.prompt_len).values())
    c, cost = run(s.batch)
    if s.metric == "output_tokens_per_s":
        return s.requests * s.response_len / cost.seconds
    if s.metric == "output_tokens_per_s_per_gpu":
        return s.requests * s.response_len / cost.seconds / s.tp
    if s.metric == "request_seconds":
        return cost.seconds * s.batch / s.requests if s.batch else cost.seconds
    if s.metric == "tpot_seconds":
        first = sum(prefill(c, model, gen, s.batch or 1, s.prompt_len).values())
        return (cost.seconds - first) / max(s.response_len - 1, 1)
    # batching_gain
    _, other = run(s.gain_batch)
    return cost.seconds / other.seconds


def price_train(s: TrainSetup, model_for: ModelFor) -> float:
    model, par = _model(s.model), s.parallel
    w = Workload(prompts=s.global_batch, prompt_len=s.seq_len - 1, response_len=1, ppo_epochs=1, mini_batches=1,
                 micro_batch_size=s.micro_batch)
    seconds = model_for(s.cluster()).train(model, "lm", par, w, recompute=s.recompute).seconds
    return s.global_batch * s.seq_len / seconds / par.world_size


def price_collective(s: CollectiveSetup, model_for: ModelFor) -> float:
    c = model_for(s.cluster())
    ranks = tuple(range(s.gpus))
    bw, lat = (c.allreduce if s.op == "allreduce" else c.allgather)(s.size_bytes, s.gpus, ranks)
    seconds = bw + lat
    if s.metric == "seconds":
        return seconds
    factor = 2.0 * (s.gpus - 1) / s.gpus if s.op == "allreduce" else (s.gpus - 1) / s.gpus  # nccl-tests' busbw
    return factor * s.size_bytes / seconds


def price_weight_sync(s: WeightSyncSetup, model_for: ModelFor) -> float:
    train, gen = ParallelConfig(dp=s.trainer_gpus), ParallelConfig(tp=s.tp, dp=s.sampler_gpus // s.tp)
    return model_for(s.cluster()).reshard(_model(s.model), train, gen, "broadcast").seconds


def price_op(setup, model_for: ModelFor = analytic) -> float:
    """A setup's figure in its record's SI unit (the metric), priced by the cost models `model_for` makes."""
    if isinstance(setup, GenerateSetup):
        return price_generate(setup, model_for)
    if isinstance(setup, TrainSetup):
        return price_train(setup, model_for)
    if isinstance(setup, CollectiveSetup):
        return price_collective(setup, model_for)
    if isinstance(setup, WeightSyncSetup):
        return price_weight_sync(setup, model_for)
    raise HflowError(f"no op-tier pricing for setup {type(setup).__name__}")
