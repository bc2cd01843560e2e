"""Engines by name: the classes a plan names (a training `backend`, a `rollout` backend), each defined in
a module imported only when a worker first asks for it, so an optional extra (megatron-core, vLLM) loads
only for a plan that uses it. Torch-free.

    TRAIN_ENGINES = Registry("training backend", {"fsdp": "hybridflow.runtime.engines.train.fsdp.engine"})
    @TRAIN_ENGINES.register("fsdp")        # in that module
    class FsdpEngine(TrainEngine): ...
    TRAIN_ENGINES.get("FSDP")              # the class (any case; an unknown name is one line)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from hybridflow.simulator.names import lookup

T = TypeVar("T", bound=type)


class Registry:
    def __init__(self, what: str, modules: dict[str, str]):
        """what: what a name names, for errors; modules: each name's defining module."""
        self.what, self.modules = what, dict(modules)
        self.classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: the class `name` selects (it also gets `backend = name`)."""
        if name not in self.modules:
            raise ValueError(f"{self.what} '{name}' is registered outside its registry's modules")

        def add(cls: T) -> T:
            cls.backend = name
            self.classes[name] = cls
            return cls

        return add

    def get(self, name: str) -> type:
        key = lookup(name, self.modules, self.what, known_as="backends")
        if key not in self.classes:
            importlib.import_module(self.modules[key])  # its @register adds it
        return self.classes[key]
