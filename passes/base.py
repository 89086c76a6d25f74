"""One pass contract and one pass manager.

A pass takes the graph module, returns `PassResult(graph_module, modified)`; `requires` and
`ensures` check its edges. The manager runs an explicit, named list, times each pass, can dump
the graph after each one, and names the failing pass and the ones that ran before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from planner.core.errors import HetplanError, PassError

# analyses write their records under keys with this prefix (passes.annotate, passes.blocks, ...):
# the dump shows exactly those, beside each node's value
PROJECT_META_PREFIX = "hetplan."


@dataclass
class PassResult:
    graph_module: fx.GraphModule
    modified: bool


class Pass:
    """Base class: override `call`; optionally `requires` / `ensures` (raise PassError)."""

    name = "pass"

    def requires(self, gm: fx.GraphModule) -> None:
        return None

    def call(self, gm: fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def ensures(self, gm: fx.GraphModule) -> None:
        return None

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        self.requires(gm)
        result = self.call(gm)
        self.ensures(result.graph_module)
        return result


@dataclass
class PassManager:
    """Runs `passes` in order; records wall time per pass (`timings_s`, by pass name, in run order);
    with `dump_dir`, writes the graph and its annotations after each pass as `001_<name>.txt`, ..."""

    passes: Sequence[Pass]
    dump_dir: Path | None = None
    timings_s: dict[str, float] = field(default_factory=dict)

    def run(self, gm: fx.GraphModule) -> PassResult:
        modified = False
        done: list[str] = []
        for i, p in enumerate(self.passes):
            start = time.perf_counter()
            try:
                result = p(gm)
            except HetplanError:
                raise
            except Exception as exc:
                ran = ", ".join(done) or "none"
                raise PassError(f"pass `{p.name}` failed: {type(exc).__name__}: {exc} (ran before: {ran})",
                                fix="report this with the model file and the cluster spec") from exc
            self.timings_s[p.name] = time.perf_counter() - start
            gm, modified = result.graph_module, modified or result.modified
            done.append(p.name)
            if self.dump_dir is not None:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                header = f"# after pass {i + 1} `{p.name}` (modified: {result.modified})\n"
                (self.dump_dir / f"{i + 1:03d}_{p.name}.txt").write_text(header + format_graph(gm))
        return PassResult(gm, modified)


def format_graph(gm: fx.GraphModule) -> str:
    """The graph as FX prints it, then every node's value (dtype and shape) and the records the
    analyses wrote on it, then the graph module's own records: what a pass changed shows in a diff.
    Times are left out, so dumps of the same inputs are equal and diff cleanly."""
    lines = [str(gm.graph).rstrip(), "", "# node annotations (node.meta)"]
    for node in gm.graph.nodes:
        notes = [f"val={describe_value(node.meta['val'])}"] if "val" in node.meta else []
        notes += [f"{k}={v!r}" for k, v in node.meta.items() if k.startswith(PROJECT_META_PREFIX)]
        lines.append(f"{node.name}: {' '.join(notes)}" if notes else f"{node.name}: -")
    records = {k: v for k, v in gm.meta.items() if k.startswith(PROJECT_META_PREFIX)}
    if records:
        lines += ["", "# graph annotations (gm.meta)"]
    for key, value in records.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}: {len(value)} items")
            lines += [f"  [{i}] {item!r}" for i, item in enumerate(value)]
        else:
            lines.append(f"{key}: {value!r}")
    return "\n".join(lines) + "\n"


def describe_value(value: Any) -> str:
    """A node's value in a few characters: `float32[2, 16]` for a tensor, tuples element-wise."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe_value(v) for v in value) + ")"
    return type(value).__name__ if value is not None else "None"


def function_pass(name: str, fn: Callable[[fx.GraphModule], bool]) -> Pass:
    """Wrap `fn(gm) -> modified` as a Pass."""

    class _FnPass(Pass):
        def call(self, gm: fx.GraphModule) -> PassResult:
            return PassResult(gm, fn(gm))

    _FnPass.name = name
    return _FnPass()
