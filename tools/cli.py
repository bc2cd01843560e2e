"""`hflow-plan`: the composition root. Each subcommand lives in its own module under tools/
with `add_parser(subparsers)` (which sets `func`) — this file only wires them and turns user
errors into one line and exit code 2 (3: a run lost a worker or node; 4: its environment failed it, e.g. no
space left; 143: stopped by SIGTERM)."""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from hybridflow.simulator.errors import HflowError, describe_validation_error
from hybridflow.tools.cli_help import OneLineErrorParser, examples

# Subcommand modules, in help order. Each imports torch/ray only inside its `run`, so the
# planning commands work without the [runtime] extra.
SUBCOMMANDS = ["simulate", "search", "compare", "run", "export", "quickstart", "profile", "replay", "lengths",
               "agent_probe"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="hflow-plan",
        description="Plan, simulate and run RLHF dataflows (HybridFlow): search placements, replay profiles, run "
                    "plans on Ray. `hflow-plan COMMAND --help` shows each command's options and examples.",
        epilog=examples("hflow-plan quickstart",
                        "hflow-plan search --gpu a100-80g --nodes 2 --algo ppo --model llama2-13b --out plan.json",
                        "hflow-plan run examples/plans/tiny-local.json --iterations 5"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"hybridflow.tools.commands.{name}").add_parser(sub)
    return parser


def package_version() -> str:
    """The installed package's version (its metadata), or "unknown" when run from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hybridflow")
    except PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a usage error (one line printed, 2), or --help / --version (0)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except HflowError as e:
        cause = getattr(e, "user_error", None)  # an error in the user's own code (a reward function)
        if cause is not None and getattr(args, "debug", False):
            import traceback

            traceback.print_exception(cause, file=sys.stderr)  # its traceback, then the one line
        print(f"hflow-plan: {e.label}: {e}", file=sys.stderr)
        return e.exit_code
    except ValidationError as e:
        print(f"hflow-plan: error: {describe_validation_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hflow-plan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
