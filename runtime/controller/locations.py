"""Where a run's checkpoints and exports go: a local path, or an fsspec URL (`s3://bucket/ckpt`,
`gs://…`, `file:///shared/ckpt`, or any protocol an installed fsspec package registers).

One type, `Location`, for both, so that the trainer, the workers and the export read and write the
same way wherever the folder is: torch DCP picks its fsspec writer/reader for a URL checkpoint id
(and its file-system one for a path), everything else goes through `Location`. A file is published
whole: on a local path written, fsynced and renamed into place (`write_atomic`); at a URL written
under a temporary name and moved (on an object store a move is a copy, one PUT, which readers see
whole or not at all, then a delete of the temporary object).

    ckpt = Location("s3://bucket/run1")          # or Location("ckpt"): made absolute here
    (ckpt / "latest").write("iter_000004\\n")
    name = (ckpt / "latest").read_text()

fsspec is imported on first use, and a URL whose protocol's package is missing is one line naming
it (`check_url`), before torch or Ray start.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import fsync_dir, write_atomic

URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+://")
# protocols whose files live in one process: the workers (other processes, other nodes) cannot see them
PROCESS_LOCAL = ("memory",)


def is_url(where: str | os.PathLike) -> bool:
    return isinstance(where, str) and bool(URL.match(where))


def check_url(url: str, flag: str) -> None:
    """One line if `url` cannot be a run's output folder here: a protocol fsspec does not know, one
    whose package is not installed (naming it), or one that lives in a single process."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise HflowError(f"{flag} {url}: URLs need fsspec: pip install fsspec") from None
    if protocol in PROCESS_LOCAL:
        raise HflowError(f"{flag} {url}: {protocol}:// lives in one process, and the workers write from their own; "
                         "give a path or URL every node sees (a shared folder, s3://, gs://)")
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise HflowError(f"{flag} {url}: fsspec knows no protocol '{protocol}'; give a local path or a URL such as "
                         "s3://bucket/folder (with s3fs installed)") from None
    except ImportError as e:
        package = known_implementations[protocol]["class"].split(".")[0]
        package = e.name or "its package" if package == "fsspec" else package  # fsspec's own, needing a library
        raise HflowError(f"{flag} {url}: {protocol}:// needs the package {package}: pip install {package} "
                         "(on every node)") from None


@contextmanager
def readable(where: str, flag: str) -> Iterator[None]:
    """A store that cannot be read (no credentials, no such bucket, no network) is one line naming it."""
    try:
        yield
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HflowError(f"{flag} {where}: cannot be read ({first[:200]}); check the URL and its credentials") \
            from None


class Location:
    """A file or folder: a local path (made absolute, on the machine that makes the Location) or an
    fsspec URL. `/` joins names; the file operations below work the same on both."""

    def __init__(self, where: str | os.PathLike | Location):
        where = where.url if isinstance(where, Location) else os.fspath(where)
        self.url = where.rstrip("/") if is_url(where) else str(Path(where).absolute())
        self._fs = None

    @property
    def is_remote(self) -> bool:
        return is_url(self.url)

    @property
    def on_local_disk(self) -> bool:
        """A path, or a file:// URL: written the local way (fsync, rename)."""
        return not self.is_remote or self.url.startswith(("file://", "local://"))

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def __truediv__(self, name: str) -> Location:
        return Location(f"{self.url}/{name}" if self.is_remote else str(Path(self.url) / name))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Location) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def fs(self):
        """The fsspec filesystem (a LocalFileSystem for a path), made on first use."""
        if self._fs is None:
            from fsspec.core import url_to_fs

            self._fs, _ = url_to_fs(self.url)
        return self._fs

    @property
    def path(self) -> str:
        """The location in its filesystem's terms (the URL without its protocol, for most)."""
        return self.fs._strip_protocol(self.url)

    # ---- reading ------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def children(self) -> list[Location]:
        """What the folder holds, by name (nothing for a missing folder)."""
        self.fs.invalidate_cache(self.path)  # other processes write here too (object stores cache listings)
        if not self.is_dir():
            return []
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False)}
        return [self / n for n in sorted(names)]

    # ---- writing ------------------------------------------------------------------------------
    def write(self, data: str | bytes) -> Location:
        """Publish the file whole: readers see the old content or the new, never a part."""
        if self.on_local_disk:
            write_atomic(self.path, data)
            return self
        self.fs.makedirs(self.fs._parent(self.path), exist_ok=True)  # nothing to make on an object store
        tmp = f"{self.path}.{secrets.token_hex(4)}.tmp"
        self.fs.pipe_file(tmp, data.encode() if isinstance(data, str) else data)
        self.fs.mv(tmp, self.path)
        return self

    def makedirs(self) -> Location:
        self.fs.makedirs(self.path, exist_ok=True)
        return self

    def remove(self) -> None:
        """Delete the file or folder (and what it holds); a missing one is no error."""
        if self.exists():
            self.fs.rm(self.path, recursive=True)

    def sync(self) -> None:
        """Make a local folder's entries durable (fsync); a remote store's writes are once they return."""
        if self.on_local_disk:
            fsync_dir(self.path)

    def upload(self, folder: str | os.PathLike) -> Location:
        """Replace this folder by a copy of a local one (for a remote store: a folder written locally
        first, then sent; a reader during the copy may see part of it, never a part of one file)."""
        self.remove()
        self.fs.put(f"{Path(folder)}/", self.path, recursive=True)
        return self
