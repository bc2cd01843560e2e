"""The docs stand alone and stay true to the CLI: every relative link resolves inside the repository,
every `hflow-plan …` line of a code block parses, and every subcommand's help shows examples that
parse and states its options' defaults."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from hybridflow.tools.cli import build_parser
from hybridflow.tools.cli_help import example_lines

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "profiles" / "README.md",
        ROOT / "examples" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def command_lines(text: str) -> list[str]:
    """`hflow-plan …` commands in the fenced code blocks (continuations joined, comments dropped)."""
    out = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("hflow-plan "):
                    out.append(part)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_relative_links_resolve_inside_the_repository(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor on the same page
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.exists() or ROOT not in path.parents:
            broken.append(target)
    assert not broken, f"{rel(doc)}: {broken}"
    assert "shared/DESIGN.md" not in doc.read_text()


SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:simulator|planner|runtime|tools|tests)/[\w/.-]*\w)")


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_source_path_a_doc_names_exists(doc):
    """A doc that names a file or folder of the repository (`runtime/rl/trainer.py`) names one that is there."""
    missing = sorted({m for m in SOURCE_PATH.findall(doc.read_text())
                      if not (ROOT / m).exists() and not (doc.parent / m).exists()})
    assert not missing, f"{rel(doc)}: {missing}"


def test_readme_links_the_architecture_page():
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()


def test_the_readme_shows_commands_and_each_one_parses():
    assert len(command_lines((ROOT / "README.md").read_text())) >= 5


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_command_in_a_code_block_parses(doc):
    parser = build_parser()
    for line in command_lines(doc.read_text()):
        argv = shlex.split(line, comments=True)[1:]
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{rel(doc)}: `{line}` does not parse")
        assert args.func is not None


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_each_subcommand_shows_examples_that_parse_and_states_its_defaults(name):
    parser, top = subcommands()[name], build_parser()
    examples = example_lines(parser)
    assert 2 <= len(examples) <= 3, examples
    for line in examples:
        assert shlex.split(line)[1] == name and top.parse_args(shlex.split(line)[1:]).func
    text = parser.format_help()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS) and action.help:
            assert f"default: {action.default}" in " ".join(text.split()), (name, action.option_strings)
