"""The run's metrics file: one JSON line per finished iteration, never two for the same iteration.

A run that stops after iteration k but whose last complete checkpoint is j < k (a crash between
the metrics line and the checkpoint, or `save_every` > 1) resumes at j + 1 and writes iterations
j + 1 … k again. `drop_after(path, j)` removes the lines of iterations after j when the run resumes
(the file is rewritten atomically), so each iteration keeps exactly one line: the one of the run
whose parameters continue.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.simulator.io import write_atomic


def append_metrics(path: Path, row: dict) -> None:
    """One line for one iteration, in one write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def drop_after(path: Path | None, iteration: int) -> int:
    """Remove the lines of iterations after `iteration` (and a torn last line a crash left); returns
    how many lines were removed. Lines without an iteration number (another tool's) are kept."""
    if path is None or not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # half a line: the process died inside the write
        if not (isinstance(row, dict) and isinstance(row.get("iteration"), int) and row["iteration"] > iteration):
            kept.append(line)
    if len(kept) != len(lines):
        write_atomic(path, "".join(f"{line}\n" for line in kept))
    return len(lines) - len(kept)
