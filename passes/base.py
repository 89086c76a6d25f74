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

import torch.fx as fx

from planner.core.errors import HetplanError, PassError


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
    """Runs `passes` in order; records wall time per pass; dumps IR to `dump_dir` if given."""

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
                (self.dump_dir / f"{i + 1:03d}_{p.name}.txt").write_text(str(gm.graph))
        return PassResult(gm, modified)


def function_pass(name: str, fn: Callable[[fx.GraphModule], bool]) -> Pass:
    """Wrap `fn(gm) -> modified` as a Pass."""

    class _FnPass(Pass):
        def call(self, gm: fx.GraphModule) -> PassResult:
            return PassResult(gm, fn(gm))

    _FnPass.name = name
    return _FnPass()
