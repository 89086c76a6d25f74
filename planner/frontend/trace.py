"""Trace a model into a flat aten-level FX graph without weights.

`torch.export` (non-strict) on meta tensors, falling back to `torch.fx.symbolic_trace`; no parameter
storage is allocated. Deep stacks of identical layers are traced once and replicated (repeated.py).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from planner.core.errors import ModelFileError
from planner.frontend import repeated


def trace(module: nn.Module, inputs: tuple[Any, ...], *, file: str = "",
          replicate_repeated: bool = False) -> fx.GraphModule:
    """Trace `module` on `inputs` into a flat aten-level GraphModule with parameters as get_attr.

    torch.export (non-strict) first; fx.symbolic_trace when export cannot handle the model. With
    `replicate_repeated`, deep stacks of identical layers are traced through a few layers and replicated
    (planner/repeated.py): the same graph, in a fraction of the time; the full trace when that fails.
    """
    module.train()
    if replicate_repeated:
        gm = repeated.trace_replicated(module, inputs, _export)
        if gm is not None:
            return gm
    export_error: Exception | None = None
    try:
        return _export(module, inputs)
    except Exception as exc:  # export failed: try the symbolic tracer before giving up
        export_error = exc
    try:
        return fx.symbolic_trace(module)
    except Exception as exc:
        raise ModelFileError(
            f"cannot trace the model: torch.export said {type(export_error).__name__}: "
            f"{str(export_error).splitlines()[0] if str(export_error) else ''}; "
            f"symbolic_trace said {type(exc).__name__}: {exc}",
            file=file, field="model", fix="remove data-dependent Python control flow from forward()") from exc


def _export(module: nn.Module, inputs: tuple[Any, ...]) -> fx.GraphModule:
    """torch.export (non-strict), unlifted to a GraphModule with get_attr parameters, guards dropped."""
    with contextlib.redirect_stderr(io.StringIO()), _without_stack_traces():
        exported = torch.export.export(module, inputs, strict=False)
    gm = exported.module()
    _strip_export_guards(gm)
    return gm


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """Skip recording a Python stack trace per node (node.meta["stack_trace"]): nothing here reads them,
    and capturing them is a fifth of the export time of a transformer (measured on Llama layers)."""
    previous = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = previous


def _strip_export_guards(gm: fx.GraphModule) -> None:
    """Drop export's input guards and metadata asserts: checks only, no values flow through them."""
    graph = gm.graph
    for node in list(graph.nodes):
        is_guard = node.op == "call_module" and str(node.target).startswith("_guards")
        is_assert = node.op == "call_function" and "_assert" in getattr(node.target, "__name__", "")
        if (is_guard or is_assert) and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
