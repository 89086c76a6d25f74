"""Frontend: load a user's model file and trace the model into an FX graph without weights.

The model file contract (see README): `model() -> nn.Module`, `batch(batch_size, step) ->
(inputs, target)`, optional `loss_fn(output, target)`. Tracing uses `torch.export` (non-strict)
on meta tensors and falls back to `torch.fx.symbolic_trace`; no parameter storage is allocated.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from planner import repeated
from planner.errors import ModelFileError

DEFAULT_NAMES = {"model": "model", "batch": "batch", "loss_fn": "loss_fn"}


@dataclass
class ModelFile:
    """A loaded model file: its module and the three contract functions."""

    path: Path
    module: ModuleType
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[tuple[Any, ...], Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    digest: str


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """Cross-entropy for integer targets, mean squared error otherwise (both means over rows)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not torch.is_floating_point(target):
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(output, target)


def load_model_file(path: str | Path, names: dict[str, str] | None = None) -> ModelFile:
    """Import `path` and check it provides the contract functions (renamable through `names`)."""
    names = {**DEFAULT_NAMES, **(names or {})}
    p = Path(path)
    if not p.is_file():
        raise ModelFileError("model file not found", file=str(path),
                             fix="pass the path of a .py file that defines model() and batch()")
    module_name = "hetplan_user_model_" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError("cannot import the model file", file=str(path), fix="use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(p.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # user code: any failure is reported as the file's error
        raise ModelFileError(f"importing the model file failed: {type(exc).__name__}: {exc}",
                             file=str(path), fix="make `python FILE` run without error") from exc
    finally:
        sys.path.pop(0)
    build = getattr(module, names["model"], None)
    if not callable(build):
        raise ModelFileError(f"no function `{names['model']}()` returning an nn.Module",
                             file=str(path), field=names["model"],
                             fix=f"define `def {names['model']}() -> nn.Module` or pass --model-fn NAME")
    batch = getattr(module, names["batch"], None)
    if not callable(batch):
        raise ModelFileError(f"no function `{names['batch']}(batch_size, step)`", file=str(path),
                             field=names["batch"],
                             fix=f"define `def {names['batch']}(batch_size, step) -> (inputs, target)`"
                                 " or pass --batch-fn NAME")
    loss_fn = getattr(module, names["loss_fn"], None) or default_loss
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    return ModelFile(p, module, build, batch, loss_fn, digest)


def example_batch(model_file: ModelFile, batch_size: int) -> tuple[tuple[Any, ...], Any]:
    """Call the file's batch() and check its shape: (tuple of inputs, target)."""
    try:
        return example_batch_for_step(model_file, batch_size, 0)
    except Exception as exc:
        raise ModelFileError(f"batch({batch_size}, 0) failed or did not return (inputs, target): {exc}",
                             file=str(model_file.path), field="batch",
                             fix="return a pair: a tuple of input tensors and a target tensor") from exc


def example_batch_for_step(model_file: ModelFile, batch_size: int, step: int) -> tuple[tuple[Any, ...], Any]:
    """The rows of step `step`: `batch(batch_size, step)`, inputs as a tuple."""
    inputs, target = model_file.batch(batch_size, step)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return tuple(inputs), target


def build_on_meta(model_file: ModelFile) -> nn.Module:
    """Build the model under the meta device: shapes only, no storage."""
    try:
        with torch.device("meta"):
            module = model_file.build()
    except Exception as exc:
        raise ModelFileError(f"model() failed on the meta device: {type(exc).__name__}: {exc}",
                             file=str(model_file.path), field="model",
                             fix="build layers with torch.nn only; no weight loading or .to(device) calls") from exc
    if not isinstance(module, nn.Module):
        raise ModelFileError(f"model() returned {type(module).__name__}, not an nn.Module",
                             file=str(model_file.path), field="model", fix="return an nn.Module")
    return module


def to_device(value: Any, device: str | torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


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
