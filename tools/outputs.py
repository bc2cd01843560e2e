"""Writing the subcommands' and benchmarks' output files, and a benchmark script's entry point (the
argument types are tools/flags.py's).

Outputs are rendered first and written after, each atomically, so a failure leaves no file
behind and never clobbers what the user had.
"""

from __future__ import annotations

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.io import write_atomic


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
