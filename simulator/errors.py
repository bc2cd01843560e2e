"""User-facing errors.

A `HflowError` carries one line that names what is wrong and how to fix it; the CLI prints it
and exits 2 (3 for a `WorkerLostError`: a run lost a worker), never with a traceback. Library
code raises it for bad input (unknown preset, a parallel config that does not divide, a
malformed file, a model that does not fit).
"""

from __future__ import annotations

from pydantic import ValidationError


class HflowError(Exception):
    """Bad input or an impossible request; `str(err)` is the one-line message for the user."""

    exit_code = 2


class WorkerLostError(HflowError):
    """A worker process or node was lost while running (killed, out of memory, node down): not bad
    input, so a different exit code; the message names the role and rank."""

    exit_code = 3


def describe_validation_error(err: ValidationError, source: str = "") -> str:
    """One line from a pydantic ValidationError: the first problem, where it is, how many more."""
    problems = err.errors()
    first = problems[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    prefix = f"{source}: " if source else ""
    return f"{prefix}field '{where}': {first['msg']}{more}"
