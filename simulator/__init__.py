"""hybridflow.simulator — the shared vocabulary and the cost model. Imports no torch and no ray."""

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.hardware import (
    HARDWARE_PRESETS,
    ClusterSpec,
    HardwareSpec,
    hardware_preset,
)
from hybridflow.simulator.vocabulary.model import MODEL_PRESETS, ModelSpec, model_preset, resolve_model
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.plan import Device, DeviceGroup, Plan, RolePlan
from hybridflow.simulator.vocabulary.roles import role_head
from hybridflow.simulator.vocabulary.timeline import OPS, Event, Timeline
from hybridflow.simulator.vocabulary.workload import Workload

__all__ = [
    "HARDWARE_PRESETS", "MODEL_PRESETS", "OPS", "ClusterSpec", "Device", "DeviceGroup",
    "Event", "HardwareSpec", "HflowError", "ModelSpec", "ParallelConfig", "Plan", "RolePlan", "Timeline",
    "Workload", "hardware_preset", "model_preset", "resolve_model", "role_head",
]
