"""Rule-based rewards named as `module:function` (or `path/to/file.py:function`), applied to a batch."""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hybridflow.simulator.errors import HflowError

RewardFn = Callable[..., float]


def load_function(ref: str, what: str = "reward function") -> RewardFn:
    """Import `module:function` or `file.py:function`; one-line HflowError when it cannot."""
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise HflowError(f"{what} '{ref}' must be written 'module:function' or 'path/to/file.py:function'")
    mod_name, fn_name = ref.split(":")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise HflowError(f"{what} '{ref}': no file {path}; give an existing Python file")
            spec = importlib.util.spec_from_file_location(f"hflow_user_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except HflowError:
        raise
    except ImportError as e:
        raise HflowError(f"{what} '{ref}': cannot import module '{mod_name}' ({e}); "
                         f"check the name and that it is on PYTHONPATH") from None
    except Exception as e:  # a user module that fails while importing
        raise HflowError(f"{what} '{ref}': importing '{mod_name}' failed with {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise HflowError(f"{what} '{ref}': module '{mod_name}' has no '{fn_name}'")
    if not callable(fn):
        raise HflowError(f"{what} '{ref}': '{fn_name}' is not callable")
    return fn


def score_responses(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                    fields: dict[str, Sequence] | None = None, name: str = "reward function") -> torch.Tensor:
    """fn(prompt, response, **row_fields) for every sample → float32 scores [B]."""
    fields = fields or {}
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        extra = {k: v[i] for k, v in fields.items() if v[i] is not None}
        value = fn(p, r, **extra)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise HflowError(f"{name} returned {value!r} for sample {i}; it must return a float") from None
        if not math.isfinite(value):
            raise HflowError(f"{name} returned {value} for sample {i}; it must return a finite float")
        out.append(value)
    return torch.tensor(out, dtype=torch.float32)
