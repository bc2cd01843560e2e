"""Reading specs from YAML/JSON (and JSON Lines) files and writing outputs atomically.

Every output file is written to a temporary file beside it and renamed into place, so a failed
command never leaves a half-written file and never clobbers what the user had.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from hybridflow.simulator.errors import HflowError, describe_validation_error

M = TypeVar("M", bound=BaseModel)
SPEC_SUFFIXES = (".json", ".yaml", ".yml")  # the spec files load_model_file reads


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The text of a file the user named, with one-line errors for a missing file, a folder and a
    binary (or non-UTF-8) file; `what` says what was expected ("a YAML or JSON file")."""
    p = Path(path)
    if p.is_dir():
        raise HflowError(f"{p}: is a folder; pass {what}")
    if not p.is_file():
        raise HflowError(f"{p}: no such file; pass the path of {what}")
    data = p.read_bytes()
    try:
        if b"\0" in data[:8192]:
            raise UnicodeDecodeError("utf-8", data[:1], 0, 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise HflowError(f"{p}: not a text file (binary data); pass {what}") from None


def read_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML or JSON file into a dict, with one-line errors for the usual mistakes."""
    p = Path(path)
    text = read_text_file(p, "a YAML or JSON file")
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        line = getattr(e, "lineno", None) or getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" (near line {line if isinstance(e, json.JSONDecodeError) else line + 1})" if line is not None else ""
        kind = "JSON" if p.suffix == ".json" else "YAML"
        raise HflowError(f"{p}: not valid {kind}{at}; fix the syntax and retry") from None
    if not isinstance(data, dict):
        raise HflowError(f"{p}: expected a mapping of fields at the top level, got {type(data).__name__}")
    return data


def read_jsonl(path: str | os.PathLike, what: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines file (one per line, blank lines skipped). `what` describes the
    file the caller expects ("a prompt file", "the metrics a run wrote"), for the one-line errors."""
    p = Path(path)
    rows = []
    for n, line in enumerate(read_text_file(p, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise HflowError(f"{p}: line {n} is not JSON; {what} has one JSON object per line") from None
        if not isinstance(row, dict):
            raise HflowError(f"{p}: line {n} is a JSON {type(row).__name__}, not an object; {what} has one "
                             "JSON object per line")
        rows.append(row)
    return rows


def load_model_file(cls: type[M], path: str | os.PathLike) -> M:
    """Validate a YAML/JSON file as the pydantic model `cls`."""
    data = read_mapping(path)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise HflowError(describe_validation_error(e, str(path))) from None


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` via a temporary file, fsynced, and a rename: all or nothing, and durable
    once it returns (a checkpoint's `latest` must never name files still in a page cache)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        # mkstemp makes 0600 files; give the output the mode a plain open() would (umask applies).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
        fsync_dir(p.parent)  # and the rename itself survives a crash of the node
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make the entries of `folder` (files created or renamed in it) durable; a no-op where the
    platform cannot open a folder (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; their renames are synchronous
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; when the block ends without error it becomes
    `path` as a whole. An existing `path` is replaced only once the new folder is complete (moved
    aside, the new one renamed in, then the old one removed); on an error nothing changes."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise HflowError(f"{target}: exists and is not a folder; give a folder path (or remove the file)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        umask = os.umask(0)  # mkdtemp makes 0700 folders; give the one a plain mkdir would
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        yield tmp
        if not target.exists():
            os.replace(tmp, target)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, old / target.name)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(old / target.name, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
