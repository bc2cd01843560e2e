"""Which checkpoint a resume may use: each `iter_N` carries `manifest.json`, the size and SHA-256 of every
file in it, written by the driver last (after every rank's shards and driver.json), before `latest`.

A checkpoint is valid when its manifest is there and every file it lists is there with that size and
checksum. A resume takes the one `latest` names if it is valid, else the newest valid one before it
(every `iter_N` when `latest` is missing or unreadable), naming each one it skipped and why. The
checks read every byte once per process (`_VERIFIED` keeps the answer): `hflow-plan run --resume`
checks before torch or Ray start, and the trainer's load reuses that.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from hybridflow.runtime.controller.locations import Location

MANIFEST = "manifest.json"
CHUNK = 1 << 22

_VERIFIED: dict[tuple[str, bytes], str | None] = {}


def _files(ckpt: Location) -> dict[str, int]:
    """{path relative to the checkpoint: size} of every file under it but the manifest."""
    fs, root = ckpt.fs, ckpt.path.rstrip("/")
    fs.invalidate_cache(root)
    out = {}
    for path, info in fs.find(root, detail=True).items():
        rel = path[len(root):].lstrip("/")
        if info.get("type", "file") == "file" and rel != MANIFEST:
            out[rel] = int(info["size"])
    return out


def _sha256(ckpt: Location, rel: str) -> str:
    h = hashlib.sha256()
    with ckpt.fs.open(f"{ckpt.path.rstrip('/')}/{rel}", "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: Location) -> None:
    files = {rel: {"size": size, "sha256": _sha256(ckpt, rel)} for rel, size in sorted(_files(ckpt).items())}
    (ckpt / MANIFEST).write(json.dumps({"version": 1, "files": files}, indent=1) + "\n")


def check_checkpoint(ckpt: Location) -> str | None:
    """None when `ckpt` is whole, else what is wrong with it (a few words naming the file)."""
    manifest = ckpt / MANIFEST
    if not ckpt.is_dir():
        return "the folder is not there"
    if not manifest.is_file():
        return f"no {MANIFEST} (a save that did not finish, or a checkpoint written before manifests)"
    raw = manifest.read_bytes()
    key = (ckpt.url, raw)
    if key not in _VERIFIED:
        _VERIFIED[key] = _verify(ckpt, raw)
    return _VERIFIED[key]


def _verify(ckpt: Location, raw: bytes) -> str | None:
    try:
        listed = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is damaged"
    present = _files(ckpt)
    for rel, want in listed.items():
        if rel not in present:
            return f"{rel} is missing"
        if present[rel] != want["size"]:
            return f"{rel} is {present[rel]} bytes, the manifest says {want['size']}"
    for rel, want in listed.items():
        if _sha256(ckpt, rel) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


@dataclass
class ResumePoint:
    checkpoint: Location | None  # None: no valid one
    skipped: list[tuple[str, str]]  # (name, why), newest first

    def skipped_lines(self) -> list[str]:
        return [f"skipped checkpoint {name}: {why}" for name, why in self.skipped]

    def none_line(self, folder: Location) -> str:
        why = "; ".join(f"{n}: {w}" for n, w in self.skipped) or "no iter_N folder"
        return (f"nothing to resume in {folder}: no complete checkpoint ({why}); run without --resume, or give the "
                "folder of a run whose checkpoints are whole")


def _number(name: str) -> int | None:
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


def resume_point(folder: Location, latest: str | None) -> ResumePoint:
    """The checkpoint a resume uses: `latest`'s if valid, else the newest valid one older than it."""
    names = sorted((p.name for p in folder.children() if _number(p.name) is not None), key=_number, reverse=True)
    limit = _number(latest) if latest is not None else None
    if latest is not None and limit is None:  # `latest` holds something that is no checkpoint name
        skipped = [("latest", f"names {latest!r}, no checkpoint")]
    else:
        skipped = []
    if limit is not None:
        if latest not in names:
            skipped.append((latest, "named by 'latest', the folder is not there"))
        names = [n for n in names if _number(n) <= limit]
    for name in names:
        why = check_checkpoint(folder / name)
        if why is None:
            return ResumePoint(folder / name, skipped)
        skipped.append((name, why))
    return ResumePoint(None, skipped)
