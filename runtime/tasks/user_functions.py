"""The user's reward and cost functions, named `module:function` or `path/to/file.py:function`: imported
(torch-free, so `search` and `run` check them before torch or Ray load) and tried once on a real row.

    fn = load_function("reward.py:last_number")                    # one line when it cannot be imported
    check_on_row(fn, "reward function 'reward.py:last_number'", rows, "data.jsonl")

`check_on_row` asks two things of a function before a run starts: every keyword it requires is a column
of every row (the row that lacks it is named), and it scores the first row's prompt with an empty
response — a response the policy can produce — as a finite number.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hybridflow.runtime.tasks.prompt_files import prompt_preview
from hybridflow.simulator.errors import HflowError

RewardFn = Callable[..., float]


def function_file(ref: str) -> Path | None:
    """The file of a `file.py:function` reference (None for `module:function`)."""
    mod = ref.split(":")[0] if isinstance(ref, str) else ""
    return Path(mod) if mod.endswith(".py") else None


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
        raise user_error(f"{what} '{ref}': importing '{mod_name}' failed with {type(e).__name__}: {e}"
                         f"{user_line(e)}", e) from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__]
        raise HflowError(f"{what} '{ref}': module '{mod_name}' has no '{fn_name}'"
                         + (f" (its functions: {', '.join(public)})" if public else ""))
    if not callable(fn):
        raise HflowError(f"{what} '{ref}': '{fn_name}' is not callable")
    return fn


def user_error(message: str, cause: BaseException) -> HflowError:
    """The one-line error for a failure in the user's code, carrying that code's exception: `--debug`
    prints its traceback (tools/cli.py)."""
    err = HflowError(message)
    err.user_error = cause
    return err


def user_line(e: BaseException) -> str:
    """' at FILE:LINE' of the innermost frame of a traceback outside hybridflow ('' when none)."""
    tb, found = e.__traceback__, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "hybridflow" not in name and "/runtime/" not in name and not name.startswith(sys.prefix):
            found = f" at {name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found or ""


def required_columns(fn: RewardFn) -> list[str]:
    """The keyword arguments `fn(prompt, response, **columns)` cannot do without ([] when unknown)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][2:]
    keyword = [p for p in params if p.kind == p.KEYWORD_ONLY]
    return [p.name for p in positional + keyword if p.default is p.empty]


def check_on_row(fn: RewardFn, name: str, rows: Sequence[dict], source: str) -> None:
    """`fn` against the data before a run: its required columns in every row, and one call with an empty
    response on the first row of each set of columns the rows have, giving a finite number. One line naming
    what is wrong otherwise."""
    for col in required_columns(fn):
        missing = [i for i, r in enumerate(rows) if r.get(col) is None]
        if missing:
            have = sorted({k for r in rows[:50] for k in r if k != "prompt"})
            raise HflowError(f"{name} needs the column '{col}', which {len(missing)} of {len(rows)} row(s) of {source} "
                             f"lack (row {missing[0] + 1} first; columns: {', '.join(have) or 'none'}); add it to "
                             "every row or give the function a default for it")
    shapes: dict[frozenset, int] = {}  # one row of each set of columns the data has: a `**row` reader is tried on each
    for i, r in enumerate(rows):
        shapes.setdefault(frozenset(k for k, v in r.items() if v is not None), i)
    for i in shapes.values():
        _call_once(fn, name, rows[i], i, source)


def _call_once(fn: RewardFn, name: str, row: dict, i: int, source: str) -> None:
    extra = {k: v for k, v in row.items() if k != "prompt" and v is not None}
    try:
        value = fn(row["prompt"], "", **extra)
    except KeyError as e:
        raise user_error(f"{name} raised KeyError {e} on row {i + 1} of {source} (prompt "
                         f"{prompt_preview(row['prompt'])!r}){user_line(e)}: a column it reads is missing there "
                         f"(its columns: {', '.join(extra) or 'none'}); add it to every row", e) from None
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        raise user_error(f"{name} raised {type(e).__name__} ({text}){user_line(e)} on row {i + 1} of {source} with "
                         "an empty response, which a policy can produce; return a score (0.0) for a response it "
                         "cannot read", e) from None
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise HflowError(f"{name} returned {str(value)[:40]!r} on row {i + 1} of {source}; it must return a "
                         "number") from None
    if not math.isfinite(number):
        raise HflowError(f"{name} returned {number} on row {i + 1} of {source}; it must return a finite number")
