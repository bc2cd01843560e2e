"""Reading specs from YAML/JSON files and writing outputs atomically.

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

from .errors import HflowError, describe_validation_error

M = TypeVar("M", bound=BaseModel)


def read_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a YAML or JSON file into a dict, with one-line errors for the usual mistakes."""
    p = Path(path)
    if not p.is_file():
        raise HflowError(f"{p}: no such file; pass the path of an existing YAML or JSON file")
    text = p.read_text()
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


def load_model_file(cls: type[M], path: str | os.PathLike) -> M:
    """Validate a YAML/JSON file as the pydantic model `cls`."""
    data = read_mapping(path)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise HflowError(describe_validation_error(e, str(path))) from None


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` to `path` via a temporary file and a rename: all or nothing."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
        # mkstemp makes 0600 files; give the output the mode a plain open() would (umask applies).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


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
