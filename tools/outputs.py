"""What several subcommands share: argument types and writing their output files.

Outputs are rendered first and written after, each atomically, so a failure leaves no file
behind and never clobbers what the user had.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic


def bounded_number(kind: type[int] | type[float], least: float, expected: str,
                   least_allowed: bool = True) -> Callable[[str], int | float]:
    """An argparse type: a finite `kind` (int or float) of at least `least` (above it, unless
    `least_allowed`); anything else is one line saying what was `expected`."""
    def parse(text: str) -> int | float:
        try:
            x = kind(text)
        except ValueError:
            x = None
        if x is None or not math.isfinite(x) or x < least or (x == least and not least_allowed):
            raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'")
        return x

    parse.__name__ = expected  # argparse names the type by it
    return parse


positive_int = bounded_number(int, 1, "a positive whole number")
non_negative_int = bounded_number(int, 0, "a whole number (0 or more)")
positive_float = bounded_number(float, 0.0, "a positive number of seconds", least_allowed=False)


def backends_arg(text: str) -> tuple[str, ...]:
    """`--backends fsdp,megatron`: the training engines a search may pick per role (one line on a typo)."""
    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in ("fsdp", "megatron")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown training backend '{(bad or [text])[0]}'; choose fsdp, megatron "
                                         "or fsdp,megatron")
    return names


def modes_arg(text: str) -> tuple[str, ...]:
    """`--modes sync,one-step-off,async`: execution modes to search side by side (one line on a typo)."""
    from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES

    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in EXECUTION_MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mode '{(bad or [text])[0]}'; choose from "
                                         f"{', '.join(EXECUTION_MODES)} (comma-separated)")
    return names


def algorithm_arg(text: str) -> str:
    """`--algo`: any case, with "did you mean" on a near miss (one line, exit 2)."""
    from hybridflow.simulator.vocabulary.plan import algorithm_name

    try:
        return algorithm_name(text)
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def mode_arg(text: str) -> str:
    """`--mode`: an execution mode, any case, with "did you mean" on a near miss."""
    from hybridflow.simulator.names import lookup
    from hybridflow.simulator.vocabulary.plan import EXECUTION_MODES

    try:
        return lookup(text, EXECUTION_MODES, "execution mode", known_as="modes")
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rollout_arg(text: str) -> str:
    """`--rollout`: a generation backend, any case, with "did you mean" on a near miss."""
    from hybridflow.simulator.names import lookup
    from hybridflow.simulator.vocabulary.plan import ROLLOUT_BACKENDS

    try:
        return lookup(text, ROLLOUT_BACKENDS, "rollout backend", known_as="backends")
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def task_arg(text: str) -> str:
    """`--task`: a built-in task, any case, with "did you mean" on a near miss (one line, exit 2)."""
    from hybridflow.runtime.tasks.builtin import get_task

    try:
        return get_task(text).name
    except HflowError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rendered_outputs(timeline, title: str, *, plan=None, out: str | None = None, trace: str | None = None,
                     png: str | None = None) -> list[tuple[str, str | bytes]]:
    """(path, data) pairs for those asked for: `plan` as JSON at `out`, `timeline` as a Chrome trace at
    `trace` and as a Gantt chart titled `title` at `png` — all rendered before any is written."""
    import json

    from hybridflow.simulator.schedule.export import chrome_trace, gantt_png

    outputs: list[tuple[str, str | bytes]] = []
    if out:
        outputs.append((out, plan.model_dump_json(indent=2) + "\n"))
    if trace:
        outputs.append((trace, json.dumps(chrome_trace(timeline)) + "\n"))
    if png:
        outputs.append((png, gantt_png(timeline, title=title)))
    return outputs


def write_outputs(outputs: list[tuple[str, str | bytes]]) -> list[str]:
    """Write rendered (path, data) pairs atomically; a path that cannot be written is a one-line error."""
    for path, data in outputs:
        try:
            write_atomic(path, data)
        except OSError as e:
            raise HflowError(f"{path}: cannot write ({e.strerror}); pick a writable location") from None
    return [p for p, _ in outputs]


def run_main(main) -> None:
    """Entry point of a benchmark script (`python -m hybridflow.tools.bench.X`): bad input ends in one
    line on stderr and exit code 2, as in `hflow-plan`."""
    import sys

    try:
        code = main()
    except HflowError as e:
        print(f"{sys.argv[0].rsplit('/', 1)[-1]}: error: {e}", file=sys.stderr)
        code = e.exit_code
    sys.exit(code)
