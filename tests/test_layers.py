"""The layer rules (tests/layering.py) hold on the project, and the checker sees them broken."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import layering  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MOST_LINES = 400          # a module a person reads in one sitting (CONVENTIONS.md)


def test_the_project_keeps_its_layers_and_has_no_cycle():
    assert layering.violations(REPO) == []


def test_no_module_of_the_packages_is_too_long_to_read():
    assert layering.long_files(REPO, MOST_LINES) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A fixture tree: the four packages with empty __init__ files, plus `files`."""
    for package in layering.PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").touch()
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if str(parent) != "." and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


CLEAN = {
    "planner/core/ir.py": "import json\n",
    "costmodel/tables.py": "from planner.core.ir import Plan\n",
    "planner/search/ilp.py": "from costmodel import tables\nfrom planner.core import ir\n",
    "backends/sim/engine.py": "from planner.search.ilp import solve\n",
    "planner/api.py": "from backends.sim import engine\n",
    "planner/cli/main.py": "def main():\n    from planner.api import plan\n",
    # leaves the cases below import upwards, so that no case is also a cycle
    "planner/search/split.py": "", "planner/runners_up.py": "", "backends/report/text.py": "",
}


def test_a_tree_that_keeps_the_order_passes(tmp_path):
    assert layering.violations(_tree(tmp_path, CLEAN)) == []


@pytest.mark.parametrize("name, text, expected", [
    # the cost model reaching up into the search, at module level
    ("costmodel/tables.py", "from planner.search.split import solve\n",
     "costmodel.tables (layer 1) imports planner.search.split (layer 3)"),
    # hidden in a function: still a dependency
    ("planner/core/ir.py", "def load():\n    from planner.runners_up import rank\n",
     "planner.core.ir (layer 0) imports planner.runners_up (layer 5)"),
    # under TYPE_CHECKING: still a dependency
    ("planner/search/ilp.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planner.runners_up import X\n",
     "planner.search.ilp (layer 3) imports planner.runners_up (layer 5)"),
    # `from package import module`
    ("backends/sim/engine.py", "from planner import cli\n",
     "backends.sim.engine (layer 4) imports planner.cli (layer 7)"),
    # a relative import, resolved against the package
    ("planner/search/ilp.py", "from ...backends.report import text\n",
     "planner.search.ilp (layer 3) imports backends.report.text (layer 4)"),
    # a package importing the tests
    ("planner/api.py", "from tests import helpers\n", "planner.api imports tests.helpers, outside the packages"),
])
def test_an_upward_import_is_reported_with_its_file_and_line(tmp_path, name, text, expected):
    files = {**CLEAN, name: text}
    if "tests" in text:
        files["tests/helpers.py"] = ""
    found = layering.violations(_tree(tmp_path, files))
    assert len(found) == 1 and expected in found[0], found
    assert found[0].startswith(f"{name}:")


def test_a_cycle_within_one_layer_is_reported(tmp_path):
    files = {**CLEAN, "planner/search/align.py": "from planner.search import ilp\n",
             "planner/search/ilp.py": "def f():\n    from planner.search.align import g\n"}
    found = layering.violations(_tree(tmp_path, files))
    assert len(found) == 1 and found[0].startswith("import cycle: ")
    assert {"planner.search.align", "planner.search.ilp"} <= set(found[0].removeprefix("import cycle: ").split(" -> "))


def test_a_long_module_is_reported(tmp_path):
    root = _tree(tmp_path, {"passes/split.py": "x = 1\n" * (MOST_LINES + 1)})
    assert layering.long_files(root, MOST_LINES) == [f"passes/split.py: {MOST_LINES + 1} lines"]
