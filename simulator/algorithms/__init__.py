"""The RL algorithms, each defined once (registry.py): its driver loop, roles, default settings, hooks.

Every module of this package is imported here, so an algorithm is added by adding its file.
"""

from __future__ import annotations

import importlib
import pkgutil

from hybridflow.simulator.algorithms.registry import (
    Algorithm,
    Hooks,
    algorithm,
    algorithm_names,
    get_algorithm,
)
from hybridflow.simulator.algorithms.settings import RLSettings, merge_settings

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Algorithm", "Hooks", "RLSettings", "algorithm", "algorithm_names", "get_algorithm", "merge_settings"]
