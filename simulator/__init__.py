"""hybridflow.simulator — the shared vocabulary and the cost model. Imports no torch and no ray."""

from .errors import HflowError
from .hardware import HARDWARE_PRESETS, ClusterSpec, HardwareSpec, hardware_preset
from .model import MODEL_PRESETS, ModelSpec, model_preset, resolve_model
from .parallel import ParallelConfig
from .plan import Device, DeviceGroup, Plan, RolePlan, role_head
from .timeline import OPS, Event, Timeline
from .workload import Workload

__all__ = [
    "HARDWARE_PRESETS", "MODEL_PRESETS", "OPS", "ClusterSpec", "Device", "DeviceGroup",
    "Event", "HardwareSpec", "HflowError", "ModelSpec", "ParallelConfig", "Plan", "RolePlan", "Timeline",
    "Workload", "hardware_preset", "model_preset", "resolve_model", "role_head",
]
