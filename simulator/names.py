"""Names users type — presets, algorithms, tasks, profiles: matched case-insensitively, and a near
miss answered with "did you mean" instead of only the list of known names."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from hybridflow.simulator.errors import HflowError


def lookup(name: str, known: Iterable[str], what: str, hint: str = "", known_as: str = "") -> str:
    """The known name that `name` means, ignoring case; else HflowError naming the closest ones and
    all the known names (listed as `known_as`, default "known <what>s"; `hint` says what else may be
    passed)."""
    known = list(known)
    by_lower = {k.lower(): k for k in known}
    hit = by_lower.get(name.strip().lower())
    if hit is not None:
        return hit
    close = difflib.get_close_matches(name.strip().lower(), list(by_lower), n=2, cutoff=0.6)
    maybe = f"did you mean {' or '.join(repr(by_lower[c]) for c in close)}? " if close else ""
    rest = f" ({hint})" if hint else ""
    listed = known_as or f"known {what.split()[-1]}s"
    raise HflowError(f"unknown {what} '{name}'; {maybe}{listed}: {', '.join(known)}{rest}")
