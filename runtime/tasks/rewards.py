"""Rule-based rewards named as `module:function` (or `path/to/file.py:function`), applied to a batch, and
the checks that every score, from a function or a score model, is a finite number."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hybridflow.runtime.tasks.data import Prompt, prompt_preview
from hybridflow.runtime.tasks.user_functions import load_function, user_error  # noqa: F401  (load_function: imported from here too)
from hybridflow.simulator.errors import HflowError

RewardFn = Callable[..., float]


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
            raise user_error(f"{name} raised {type(e).__name__} ({str(e).splitlines()[0] if str(e) else ''}) on "
                             f"{where}, response {prompt_preview(r)!r}; fix the function", e) from None
        out.append(as_score(value, name, where))
    return torch.tensor(out, dtype=torch.float32)


def as_score(value, name: str, where: str) -> float:
    """A function's return value as a score: a finite number, else one line naming the function and sample."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise HflowError(f"{name} returned {str(value)[:40]!r} for {where}; it must return a number") from None
    if not math.isfinite(number):
        raise HflowError(f"{name} returned {number} for {where}; it must return a finite number")
    return number


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
