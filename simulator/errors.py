"""User-facing errors.

A `HflowError` carries one line that names what is wrong and how to fix it; the CLI prints it
and exits 2 (3 for a `WorkerLostError`: a run lost a worker; 4 for an `EnvironmentFaultError`: no space
left, a storage error; 143 for a `PreemptedError`: SIGTERM), never with a traceback. Library
code raises it for bad input (unknown preset, a parallel config that does not divide, a
malformed file, a model that does not fit).
"""

from __future__ import annotations

from pydantic import ValidationError


class HflowError(Exception):
    """Bad input or an impossible request; `str(err)` is the one-line message for the user."""

    exit_code = 2
    label = "error"  # the CLI's "hflow-plan: error: …"


class WorkerLostError(HflowError):
    """A worker process or node was lost while running (killed, out of memory, node down): not bad
    input, so a different exit code; the message names the role and rank."""

    exit_code = 3


class EnvironmentFaultError(HflowError):
    """The run's environment failed it (no space left, a storage error): not the input, not a lost
    worker; the message names the resource and the folder."""

    exit_code = 4


class PreemptedError(HflowError):
    """The run was asked to stop (SIGTERM, a job scheduler's notice) and did, having saved what it could;
    128 + SIGTERM, as a shell reports a process that SIGTERM ended."""

    exit_code = 143
    label = "stopped"


def describe_validation_error(err: ValidationError, source: str = "") -> str:
    """One line from a pydantic ValidationError: the first problem, where it is, how many more."""
    problems = err.errors()
    first = problems[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")  # a validator's own sentence, as it wrote it
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    prefix = f"{source}: " if source else ""
    field = f"field '{where}': " if where else ""  # a whole-object check names its fields itself
    return f"{prefix}{field}{msg}{more}"
