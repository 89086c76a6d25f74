"""The benchmark scripts run with benchmarks/ first on sys.path (`python benchmarks/x.py`), and tests import
them that way: a script named like an installed package would then stand in for it. transformers 5 imports
the package `kernels` and once found benchmarks/kernels.py instead, failing every Hugging Face test of the
worker that had imported a benchmark before."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.helpers import BENCHMARKS, import_benchmark


def test_no_benchmark_script_shares_its_name_with_an_installed_module():
    clashes = []
    for script in sorted(BENCHMARKS.glob("*.py")):
        name = script.stem
        if name in sys.builtin_module_names or name in sys.stdlib_module_names:
            clashes.append(f"{script.name}: the standard library's {name}")
            continue
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        origin = spec.origin if spec is not None else None
        if origin is not None and BENCHMARKS not in Path(origin).parents:
            clashes.append(f"{script.name}: installed as {origin}")
    assert clashes == []


def test_importing_a_benchmark_leaves_sys_path_as_it_was():
    before = list(sys.path)
    module = import_benchmark("common")
    assert module.__file__ is not None and module.__file__.startswith(str(BENCHMARKS))
    assert sys.path == before
