"""What every node must see: the run's output folders and the model folders, checked at start.

Each rank writes its checkpoint shards from its own node, while the driver writes `driver.json`
and `latest`; a checkpoint is whole only on storage that every node mounts at the same path. So
before any weights load, the driver writes a marker file with a random token into each output
folder (checkpoint dir, export dir: a path, or a URL read through fsspec) and every worker reads
it back; each role's model folder (a user's, or the built-in policy the driver warmed up into its
cache) must exist on every node of its group. We check rather than stage: copying a 70B folder to
every node is the cluster's job (a shared filesystem), and a check costs one small file per folder.

    with output_markers({"--checkpoint-dir": ckpt}) as shared:  # [SharedPath, ...]
        WorkerGroup(pool, roles, shared_paths=shared + model_paths(...))  # one line naming the node
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybridflow.runtime.controller.locations import Location

MARKER_PREFIX = ".hflow-shared-"
SHARED_HINT = "every node must see it at the same path (a shared filesystem: NFS, Lustre, a mounted bucket)"


@dataclass(frozen=True)
class SharedPath:
    """A path the workers must see as the driver does: `token` is the content of the driver's marker
    file (read back), or None for a file that must merely exist."""

    path: str
    what: str  # for the message: "--checkpoint-dir /shared/ckpt", "the actor's model folder /m"
    token: str | None = None

    def problem(self) -> str | None:
        """Why this process does not see the path as the driver does (None: it does). Runs on a worker."""
        p = Path(self.path)
        if self.token is None:
            return None if p.exists() else f"{p.name} is missing there"
        try:
            text = Location(self.path).read_text()  # a path or a URL alike
        except (OSError, ValueError):
            return "the driver's marker file is not there (a folder local to each node?)"
        except ImportError as e:
            return f"{e.name or 'the package of its protocol'} is not installed there (pip install it on every node)"
        return None if text == self.token else "another marker is there: that node has a different folder at this path"


@contextmanager
def output_markers(folders: dict[str, Location | None]) -> Iterator[list[SharedPath]]:
    """A marker file in each named output folder (a path or a URL; created if need be) while the block
    runs; the SharedPaths that check them. `folders` maps a description ("--checkpoint-dir") to a folder."""
    written: list[Location] = []
    shared = []
    try:
        for what, folder in folders.items():
            if folder is None:
                continue
            token = secrets.token_hex(16)
            marker = (folder / f"{MARKER_PREFIX}{token[:8]}").write(token)
            written.append(marker)
            shared.append(SharedPath(str(marker), f"{what} {folder}", token))
        yield shared
    finally:
        for marker in written:
            marker.remove()


def model_folder(path: str, what: str) -> SharedPath:
    """A role's weights folder: its config.json must be there on every node of the role's group."""
    return SharedPath(str(Path(path) / "config.json"), f"{what} {path}")


def describe_problems(problems: list[tuple[SharedPath, str]], where: str) -> str:
    """One line: the first path `where` (a node) does not see as the driver does, and the others."""
    (first, why), rest = problems[0], problems[1:]
    also = f"; nor {', '.join(p.what for p, _ in rest)}" if rest else ""
    return f"{first.what} is not visible on {where}: {why}{also}; {SHARED_HINT}"
