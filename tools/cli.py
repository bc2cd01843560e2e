"""`hflow-plan`: the composition root. Each subcommand lives in its own module under tools/
with `add_parser(subparsers)` (which sets `func`) — this file only wires them and turns user
errors into one line and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from hybridflow.simulator.errors import HflowError, describe_validation_error

# Subcommand modules, in help order. Each imports torch/ray only inside its `run`, so the
# planning commands work without the [runtime] extra.
SUBCOMMANDS = ["simulate", "search", "compare", "run", "export", "quickstart", "profile", "replay"]


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes end in one line and exit code 2, like every other bad input (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="hflow-plan",
        description="Plan, simulate and run RLHF dataflows (HybridFlow): search placements, replay profiles, run plans on Ray.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"hybridflow.tools.cmd_{name}").add_parser(sub)
    return parser




def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HflowError as e:
        print(f"hflow-plan: error: {e}", file=sys.stderr)
        return e.exit_code
    except ValidationError as e:
        print(f"hflow-plan: error: {describe_validation_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hflow-plan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
