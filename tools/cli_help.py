"""How `hflow-plan` parses and explains itself: one-line usage errors, no prefix matching of flags,
each option's default stated in its help, and real examples under each subcommand's help."""

from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped; example lines (indented) kept as written; each option's default stated
    unless its help already says it or it has none (None / False / an empty list)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith("  ") for line in lines):
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(textwrap.fill(" ".join(lines), width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or default == []):
            return text
        return f"{text} (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes end in one line and exit code 2, like every other bad input (no usage dump).
    Flags must be given in full: prefix matching would let `--gpus 4` mean `--gpus-per-node 4`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def examples(*lines: str) -> str:
    """An epilog of example command lines (each a real `hflow-plan …` line; tests parse them)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def example_lines(parser: argparse.ArgumentParser) -> list[str]:
    """The example command lines of a parser's epilog (for the docs check)."""
    text = parser.epilog or ""
    return [line.strip() for line in text.splitlines() if line.strip().startswith("hflow-plan ")]
