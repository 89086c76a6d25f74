"""The project's layers, read from the code's imports (AST), and the rules they must keep.

Dependencies run one way, bottom to top:

    0  planner.core                  errors, units, the spec's records, the plan IR, schedules, blocks
    1  costmodel                     what things cost: ops, compute, memory, network, compression, tables
    2  planner.frontend, passes      load + trace the inputs; analysis and lowering passes
    3  planner.search                the costed problem -> a plan (CP-SAT, splits, baselines, assemble)
    4  backends                      what runs or shows a plan: program, simulator, kernels, reports
    5  planner.api, planner.runners_up, planner   the face: `plan()` and what it orchestrates
    6  planner.profiling             measuring this machine (`plan profile`)
    7  planner.cli                   the command line, over all of it

A module may import its own layer and the ones below; every import counts, also one inside a
function or under `TYPE_CHECKING` (deferring an import hides a dependency, it does not remove it).
No module of the packages imports tests or benchmarks, and no two modules import each other, even
through others (a cycle). `violations(root)` lists every broken rule as one line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

PACKAGES = ("planner", "passes", "costmodel", "backends")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("planner.core",),
    ("costmodel",),
    ("planner.frontend", "passes"),
    ("planner.search",),
    ("backends",),
    ("planner.api", "planner.runners_up", "planner"),
    ("planner.profiling",),
    ("planner.cli",),
)
OUTSIDE = ("tests", "benchmarks")   # may import anything; nothing of the packages imports them


@dataclass(frozen=True)
class Import:
    source: str        # importing module
    target: str        # imported module (the deepest one that exists)
    line: int


def modules(root: Path) -> dict[str, Path]:
    """Every module of the packages under `root`, by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepest module of the project `name` refers to (`a.b.func` -> `a.b`); None if outside it."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(root: Path) -> list[Import]:
    """Every import of every module of the packages (and of tests/benchmarks importing nothing else)."""
    known = modules(root)
    extra = {name: path for top in OUTSIDE for path in sorted((root / top).rglob("*.py"))
             for name in [".".join(path.relative_to(root).with_suffix("").parts)]}
    out = []
    for source, path in known.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package):
                resolved = _resolve(target, known) or _resolve(target, extra)
                if resolved and resolved != source:
                    out.append(Import(source, resolved, node.lineno))
    return out


def _targets(node: ast.AST, package: str) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:   # relative: up from this module's package
            parts = package.split(".")
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        for alias in node.names:   # `from pkg import mod` imports pkg.mod when it is a module
            yield f"{base}.{alias.name}"


def layer_of(module: str) -> int | None:
    """The layer of `module`: the one with its longest matching prefix (None: tests, benchmarks)."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def violations(root: Path) -> list[str]:
    """Every import against the layer order, every import of tests/benchmarks, every cycle."""
    found = []
    graph = nx.DiGraph()
    for imp in imports(root):
        src, dst = layer_of(imp.source), layer_of(imp.target)
        where = f"{modules(root)[imp.source].relative_to(root)}:{imp.line}"
        if dst is None:
            found.append(f"{where}: {imp.source} imports {imp.target}, outside the packages")
            continue
        if src is not None and dst > src:
            found.append(f"{where}: {imp.source} (layer {src}) imports {imp.target} (layer {dst}), "
                         f"a layer above it")
        graph.add_edge(imp.source, imp.target)
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            cycle = nx.find_cycle(graph.subgraph(component))
            found.append("import cycle: " + " -> ".join([a for a, _ in cycle] + [cycle[0][0]]))
    return sorted(found)


def long_files(root: Path, most_lines: int) -> list[str]:
    """Modules of the packages longer than `most_lines` lines."""
    out = []
    for path in modules(root).values():
        count = len(path.read_text().splitlines())
        if count > most_lines:
            out.append(f"{path.relative_to(root)}: {count} lines")
    return out
