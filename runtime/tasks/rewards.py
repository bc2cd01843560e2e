"""Rule-based rewards named as `module:function` (or `path/to/file.py:function`), applied to a batch, and
the checks that every score, from a function or a score model, is a finite number."""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hybridflow.runtime.tasks.data import Prompt, prompt_preview
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


def describe_sample(i: int, prompt: Prompt, row: int | None = None, source: str = "") -> str:
    """Where a score came from, for one-line errors: the sample, its data row and its prompt."""
    at = f"row {row + 1} of {source or 'the prompts'}, " if row is not None else ""
    return f"sample {i} ({at}prompt {prompt_preview(prompt)!r})"


def score_responses(fn: RewardFn, prompts: Sequence[Prompt], responses: Sequence[str],
                    fields: dict[str, Sequence] | None = None, name: str = "reward function",
                    rows: Sequence[int] | None = None, source: str = "") -> torch.Tensor:
    """fn(prompt, response, **row_fields) for every sample → float32 scores [B]. A function that
    raises, or returns a non-number, NaN or inf, is a one-line error naming it, the sample (its data
    row of `source` when `rows` are given) and the value."""
    fields = fields or {}
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        extra = {k: v[i] for k, v in fields.items() if v[i] is not None}
        where = describe_sample(i, p, None if rows is None else rows[i], source)
        try:
            value = fn(p, r, **extra)
        except Exception as e:
            raise HflowError(f"{name} raised {type(e).__name__} ({str(e).splitlines()[0] if str(e) else ''}) on "
                             f"{where}, response {prompt_preview(r)!r}; fix the function") from None
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError):
            raise HflowError(f"{name} returned {str(value)[:40]!r} for {where}; it must return a number") from None
        if not math.isfinite(number):
            raise HflowError(f"{name} returned {number} for {where}; it must return a finite number")
        out.append(number)
    return torch.tensor(out, dtype=torch.float32)


def check_finite_scores(scores: torch.Tensor, name: str, prompts: Sequence[Prompt],
                        rows: Sequence[int] | None = None, source: str = "") -> None:
    """A score model's scores must be finite: a one-line error naming the model, the first bad sample
    and its value otherwise."""
    bad = (~torch.isfinite(scores.float())).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        where = describe_sample(i, prompts[i], None if rows is None else rows[i], source)
        raise HflowError(f"{name} scored {scores[i].item()} for {where}; a score model must give finite scores: "
                         "check its weights (NaN or inf in the checkpoint?)")
