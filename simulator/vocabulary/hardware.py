"""Hardware and cluster specs, with presets.

Figures are vendor datasheet numbers (dense bf16 peak, HBM bandwidth and capacity, NVLink) and
the paper's testbed network (HybridFlow §8.1: 200 Gb/s between machines). Bandwidths are
bytes/s *per direction*, the figure a ring collective sees: NVLink3's "600 GB/s" is 300 GB/s
each way. What a device really achieves is the cost model's business (efficiency terms that
profiles calibrate), not the spec's.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from hybridflow.simulator.names import lookup
from hybridflow.simulator.vocabulary.units import GiB, MiB


class HardwareSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    peak_flops: PositiveFloat = Field(description="dense bf16 FLOP/s per device")
    hbm_bandwidth: PositiveFloat = Field(description="device memory bandwidth, bytes/s")
    hbm_bytes: PositiveFloat = Field(description="device memory capacity, bytes")
    intra_node_bandwidth: PositiveFloat = Field(description="per-device link bandwidth inside a node, bytes/s each way")
    inter_node_bandwidth: PositiveFloat = Field(description="per-node network bandwidth, bytes/s each way")
    intra_node_latency: PositiveFloat = Field(8e-6, description="fixed seconds per collective inside a node")
    inter_node_latency: PositiveFloat = Field(2.5e-5, description="fixed seconds per collective across nodes")
    host_bandwidth: PositiveFloat = Field(25e9, description="device<->host copy bandwidth (offload/onload), bytes/s")
    nics_per_node: PositiveInt = Field(1, description="network interfaces sharing inter_node_bandwidth: one device "
                                       "sending alone across nodes gets one of them")
    source: str = ""


# Datasheets: NVIDIA A100 (2020), H100 SXM5 and H200 SXM (2023/2024); the A800 and H800 are the A100 and H100
# with NVLink cut to 400 GB/s, the H20 a Hopper part with a fraction of the H100's compute. Latencies: NCCL small-message
# all-reduce on NVLink ~8 us, over InfiniBand/RoCE ~25 us (nccl-tests, DGX systems).
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-80g": HardwareSpec(
        name="a100-80g", peak_flops=312e12, hbm_bandwidth=2.039e12, hbm_bytes=80 * GiB,
        intra_node_bandwidth=300e9, inter_node_bandwidth=25e9, host_bandwidth=25e9,
        source="NVIDIA A100 80GB SXM datasheet; NVLink3 600 GB/s bidirectional; 200 Gb/s NIC per node (paper §8.1)",
    ),
    "h100-80g": HardwareSpec(
        name="h100-80g", peak_flops=989e12, hbm_bandwidth=3.35e12, hbm_bytes=80 * GiB,
        intra_node_bandwidth=450e9, inter_node_bandwidth=400e9, host_bandwidth=50e9,
        nics_per_node=8,
        source="NVIDIA H100 SXM5 datasheet; NVLink4 900 GB/s bidirectional; 8x400 Gb/s NICs per node",
    ),
    "a100-40g": HardwareSpec(
        name="a100-40g", peak_flops=312e12, hbm_bandwidth=1.555e12, hbm_bytes=40 * GiB,
        intra_node_bandwidth=300e9, inter_node_bandwidth=25e9, host_bandwidth=25e9,
        source="NVIDIA A100 40GB SXM datasheet; NVLink3 600 GB/s bidirectional; 200 Gb/s NIC per node",
    ),
    "a800-80g": HardwareSpec(
        name="a800-80g", peak_flops=312e12, hbm_bandwidth=2.039e12, hbm_bytes=80 * GiB,
        intra_node_bandwidth=200e9, inter_node_bandwidth=25e9, host_bandwidth=25e9,
        source="NVIDIA A800 80GB SXM (the A100 with NVLink cut to 400 GB/s bidirectional); 200 Gb/s NIC per node",
    ),
    "h800-80g": HardwareSpec(
        name="h800-80g", peak_flops=989e12, hbm_bandwidth=3.35e12, hbm_bytes=80 * GiB,
        intra_node_bandwidth=200e9, inter_node_bandwidth=400e9, host_bandwidth=50e9,
        nics_per_node=8,
        source="NVIDIA H800 SXM (the H100 with NVLink cut to 400 GB/s bidirectional); 8x400 Gb/s NICs per node",
    ),
    "h20-96g": HardwareSpec(
        name="h20-96g", peak_flops=148e12, hbm_bandwidth=4.0e12, hbm_bytes=96 * GiB,
        intra_node_bandwidth=450e9, inter_node_bandwidth=400e9, host_bandwidth=50e9,
        nics_per_node=8,
        source="NVIDIA H20 datasheet (148 TFLOP/s dense bf16, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s bidirectional)",
    ),
    "h200-141g": HardwareSpec(
        name="h200-141g", peak_flops=989e12, hbm_bandwidth=4.8e12, hbm_bytes=143771 * MiB,
        intra_node_bandwidth=450e9, inter_node_bandwidth=400e9, host_bandwidth=50e9,
        nics_per_node=8,
        source="NVIDIA H200 SXM datasheet; NVLink4 900 GB/s bidirectional; 8x400 Gb/s NICs per node",
    ),
}


def hardware_preset(name: str) -> HardwareSpec:
    """A datasheet spec by name (any case; a near miss is answered with "did you mean")."""
    return HARDWARE_PRESETS[lookup(name, sorted(HARDWARE_PRESETS), "hardware preset", "or pass a YAML/JSON file")]


class ClusterSpec(BaseModel):
    """`nodes` machines of `devices_per_node` identical devices each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hardware: HardwareSpec
    nodes: PositiveInt = 1
    devices_per_node: PositiveInt = 8

    @model_validator(mode="before")
    @classmethod
    def _hardware_by_name(cls, data):
        # `hardware: a100-80g` in a YAML file means the preset.
        if isinstance(data, dict) and isinstance(data.get("hardware"), str):
            data = {**data, "hardware": hardware_preset(data["hardware"])}
        return data

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node
