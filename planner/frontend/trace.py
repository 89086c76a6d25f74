"""Trace a model into a flat aten-level FX graph without weights.

`torch.export` (non-strict) on meta tensors, falling back to `torch.fx.symbolic_trace`; no parameter
storage is allocated. Deep stacks of identical layers are traced once and replicated (repeated.py).
`trace_model` is planning's way in: the model file's contract checked around the trace, its code
under a time limit, its failures (a wrong input width included) reported as the model file's errors.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import TreeSpec, tree_leaves, tree_unflatten

from planner.core.errors import ModelFileError
from planner.frontend import repeated
from planner.frontend.model_file import (
    ModelFile,
    build_on_meta,
    check_batch_rows,
    check_loss,
    describe,
    example_batch,
    to_device,
)
from planner.frontend.user_code import user_code


def trace_model(model_file: ModelFile, trace_batch: int) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    """Build the model on meta, trace it on `batch(trace_batch, 0)` and check the contract on the way:
    parameters, batch rows at two sizes, the forward on the traced batch, the loss on its output.
    Returns the graph and its meta inputs. Raises ModelFileError naming what in the file is wrong."""
    file = str(model_file.path)
    module = build_on_meta(model_file)
    inputs, target = example_batch(model_file, trace_batch)
    check_batch_rows(model_file, trace_batch, inputs, target)
    meta_inputs = to_device(inputs, "meta")
    with user_code(file, "tracing model()'s forward", model_file.time_limit_s, field="model"):
        gm = trace(module, meta_inputs, file=file, replicate_repeated=True)
        output = _graph_output(gm, meta_inputs, file)
    check_loss(model_file, output, to_device(target, "meta"))
    return gm, meta_inputs


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
            f"{_first_line(export_error)}; symbolic_trace said {type(exc).__name__}: {_first_line(exc)}",
            file=file, field="model", fix="remove data-dependent Python control flow from forward()") from exc


def _graph_output(gm: fx.GraphModule, meta_inputs: tuple[Any, ...], file: str) -> Any:
    """What the program's last stage hands the loss: the graph's one output tensor, or the tuple of them,
    as meta tensors; from the values the tracer recorded, else by running the graph on the meta inputs
    (symbolic_trace records none: a model that does not fit its inputs fails here, as its own error)."""
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    recorded = [n.meta.get("val") for n in tree_leaves(output_node.args) if isinstance(n, fx.Node)]
    values = [v for v in recorded if isinstance(v, torch.Tensor)]
    if len(values) < len(recorded):
        try:
            with torch.no_grad():
                values = [v for v in tree_leaves(gm(*meta_inputs)) if isinstance(v, torch.Tensor)]
        except Exception as exc:
            raise ModelFileError(f"model()'s forward fails on the traced batch {describe(meta_inputs)}: "
                                 f"{type(exc).__name__}: {_first_line(exc)}", file=file, field="model",
                                 fix="make model() take what batch() returns (shapes, dtypes)") from exc
    tensors = [torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for v in values]
    if not tensors:
        raise ModelFileError("model()'s forward returns no tensor", file=file, field="model",
                             fix="return the model's output (a tensor, or a tuple of tensors)")
    spec = export_output_spec(gm)
    if spec is not None and spec.num_leaves == len(tensors):
        return tree_unflatten(tensors, spec)              # a tuple, a dict, a ModelOutput
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def export_output_spec(gm: fx.GraphModule) -> TreeSpec | None:
    """The tree torch.export recorded for what the model's forward returns (kept by the GraphModule's
    pytree code generation); None for a graph of the symbolic tracer."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return info.out_spec if info is not None else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


def _export(module: nn.Module, inputs: tuple[Any, ...]) -> fx.GraphModule:
    """torch.export (non-strict), unlifted to a GraphModule with get_attr parameters, guards dropped;
    what torch logs meanwhile (a failed export logs its whole stack) is not shown: a failure is reported
    once, by `trace`."""
    with contextlib.redirect_stderr(io.StringIO()), _without_stack_traces(), _without_logging():
        exported = torch.export.export(module, inputs, strict=False)
    gm = exported.module()
    _strip_export_guards(gm)
    return gm


@contextlib.contextmanager
def _without_logging() -> Iterator[None]:
    """No log records while the body runs (torch's handlers hold the real stderr: redirecting it misses them)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


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
