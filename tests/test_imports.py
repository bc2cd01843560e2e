"""The import structure, read from the sources: every import statement of every module under simulator/,
planner/, runtime/ and tools/ (module level, inside functions, under `if TYPE_CHECKING:`) is an edge of
one module graph, and the graph has no cycle and no edge that goes up or across where it may not.

Layers: simulator imports nothing of ours outside simulator; planner only simulator; runtime only
simulator; tools anything. The probes (runtime/measure/) are never on the run path, so nothing else in
runtime imports them; a subcommand module (tools/commands/) never imports another: what two share
lives in tools/flags.py or another non-command module."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hybridflow"
FOLDERS = ("simulator", "planner", "runtime", "tools")
# What each top-level folder may import of ours, itself included.
MAY_IMPORT = {
    "simulator": {"simulator"},
    "planner": {"planner", "simulator"},
    "runtime": {"runtime", "simulator"},
    "tools": set(FOLDERS),
}
MEASURE = f"{PACKAGE}.runtime.measure"
COMMANDS = f"{PACKAGE}.tools.commands"
# The runtime's loop (the controller, the workers, their engines, the RL loop) reads the simulator's
# vocabulary and algorithms, never its pricing, schedule or calibration: the rules both follow are in
# simulator/vocabulary/execution.py.
LOOP = tuple(f"{PACKAGE}.runtime.{p}" for p in ("controller", "workers", "engines", "rl"))
PRICING = tuple(f"{PACKAGE}.simulator.{p}" for p in ("pricing", "schedule", "calibration"))


def module_name(path: Path, root: Path) -> str:
    """`hybridflow.<folder>.<dotted path>` of a source file; a package's __init__ is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def resolve(name: str, modules: set[str]) -> str | None:
    """The module of ours a dotted name names: its longest prefix that is a known module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in modules:
            return prefix
    return None


def imported_modules(text: str, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ours that a module's import statements name, anywhere in its file; relative
    imports resolved; `from pkg import mod` names pkg.mod when that is a module, else pkg."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(text, filename=module)):
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name, modules) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else resolve(source, modules))
    return {m for m in found if m is not None and m != module}


def module_graph(sources: dict[str, tuple[str, bool]]) -> nx.DiGraph:
    """The import graph of {module: (its source, whether it is a package __init__)}."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for module, (text, is_package) in sources.items():
        graph.add_edges_from((module, t) for t in imported_modules(text, module, is_package, set(sources)))
    return graph


def folder(module: str) -> str:
    return module.split(".")[1]


def cycles(graph: nx.DiGraph) -> list[tuple[str, ...]]:
    """Each strongly connected component of more than one module, its modules sorted."""
    return sorted(tuple(sorted(c)) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def forbidden_edges(graph: nx.DiGraph) -> list[tuple[str, str, str]]:
    """(importer, imported, why) for each import that goes up a layer, reaches the probes from the run
    path, or joins two subcommands."""
    bad = []
    for a, b in sorted(graph.edges):
        if folder(b) not in MAY_IMPORT[folder(a)]:
            bad.append((a, b, f"{folder(a)} may not import {folder(b)}"))
        elif folder(a) == "runtime" and not _within(a, MEASURE) and _within(b, MEASURE):
            bad.append((a, b, "only runtime/measure imports the probes"))
        elif any(_within(a, p) for p in LOOP) and any(_within(b, p) for p in PRICING):
            bad.append((a, b, "the runtime's loop reads the simulator's vocabulary, not its pricing"))
        elif _within(a, COMMANDS) and a != COMMANDS and _within(b, COMMANDS) and b != COMMANDS:
            bad.append((a, b, "a subcommand imports another subcommand"))
    return bad


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def source_tree() -> dict[str, tuple[str, bool]]:
    return {module_name(p, ROOT): (p.read_text(), p.name == "__init__.py")
            for f in FOLDERS for p in sorted((ROOT / f).rglob("*.py"))}


def test_no_import_cycles():
    found = [c for c in cycles(module_graph(source_tree()))]
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_forbidden_imports():
    found = [e for e in forbidden_edges(module_graph(source_tree()))]
    assert not found, "forbidden imports:\n" + "\n".join(f"{a} -> {b}: {why}" for a, b, why in found)


def test_the_tree_is_read():
    graph = module_graph(source_tree())
    assert ("hybridflow.tools.cli", "hybridflow.simulator.errors") in graph.edges
    assert graph.number_of_nodes() > 100


# The checker on a synthetic package: each kind of import resolved, each kind of fault found.
SYNTHETIC = {
    "hybridflow.simulator": ("from hybridflow.simulator.a import A\n", True),
    "hybridflow.simulator.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from hybridflow.simulator.b import B\n", False),
    "hybridflow.simulator.b": ("def f():\n    from . import a\n", False),
    "hybridflow.planner.p": ("import hybridflow.simulator.a.A\nfrom ..simulator import b\n", False),
    "hybridflow.runtime.measure": ("", True),
    "hybridflow.runtime.measure.probe": ("from hybridflow.runtime.controller import run_path\n", False),
    "hybridflow.runtime.controller": ("", True),
    "hybridflow.runtime.controller.run_path": ("from hybridflow.runtime.measure import probe\n"
                                               "from hybridflow.planner.p import P\n", False),
    "hybridflow.tools.commands": ("", True),
    "hybridflow.tools.commands.one": ("from hybridflow.tools.flags import role_flag\n", False),
    "hybridflow.tools.commands.two": ("from hybridflow.tools.commands.one import x\n"
                                      "from hybridflow.runtime.measure import probe\n", False),
    "hybridflow.tools.flags": ("import argparse\nfrom hybridflow.simulator import a\n", False),
    "hybridflow.simulator.pricing.cost": ("", False),
    "hybridflow.simulator.vocabulary.plan": ("", False),
    "hybridflow.runtime.rl.loop": ("from hybridflow.simulator.pricing.cost import price\n"
                                   "from hybridflow.simulator.vocabulary.plan import Plan\n", False),
}


def test_checker_resolves_every_kind_of_import():
    graph = module_graph(SYNTHETIC)

    def imports(module: str) -> set[str]:
        return {m.removeprefix("hybridflow.") for m in graph.successors(f"hybridflow.{module}")}

    assert imports("simulator") == {"simulator.a"}  # a package __init__ is a module like any other
    assert imports("simulator.a") == {"simulator.b"}  # under TYPE_CHECKING
    assert imports("simulator.b") == {"simulator.a"}  # relative, inside a function
    assert imports("planner.p") == {"simulator.a", "simulator.b"}  # a dotted name's module; `from pkg import mod`
    assert imports("tools.flags") == {"simulator.a"}


def test_checker_finds_cycles_and_forbidden_imports():
    graph = module_graph(SYNTHETIC)
    assert cycles(graph) == [("hybridflow.runtime.controller.run_path", "hybridflow.runtime.measure.probe"),
                             ("hybridflow.simulator.a", "hybridflow.simulator.b")]
    assert [e[:2] for e in forbidden_edges(graph)] == [
        ("hybridflow.runtime.controller.run_path", "hybridflow.planner.p"),
        ("hybridflow.runtime.controller.run_path", "hybridflow.runtime.measure.probe"),
        ("hybridflow.runtime.rl.loop", "hybridflow.simulator.pricing.cost"),
        ("hybridflow.tools.commands.two", "hybridflow.tools.commands.one"),
    ]
