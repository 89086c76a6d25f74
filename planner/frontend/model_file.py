"""Load a user's model file and check its contract.

The model file contract (see README): `model() -> nn.Module`, `batch(batch_size, step) ->
(inputs, target)`, optional `loss_fn(output, target)`. Planning checks it where it can before the
search: the model has trainable parameters, `batch(B, k)` returns B rows (at two sizes, so a
`batch()` that ignores B is caught), `loss_fn` returns a scalar on the traced output. The file's
code runs under planner.frontend.user_code (a time limit; its exits reported as its errors).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from planner.core.errors import ModelFileError
from planner.frontend.user_code import user_code

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
    time_limit_s: float | None = None     # for each call into the file's code (None: no limit)


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """Cross-entropy for integer targets, mean squared error otherwise (both means over rows)."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not torch.is_floating_point(target):
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(output, target)


def load_model_file(path: str | Path, names: dict[str, str] | None = None,
                    time_limit_s: float | None = None) -> ModelFile:
    """Import `path` and check it provides the contract functions (renamable through `names`); the
    import and every later call into the file's code stop after `time_limit_s` (None: no limit)."""
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
        with user_code(str(path), "importing the model file", time_limit_s):
            spec.loader.exec_module(module)
    except Exception as exc:  # user code: any failure is reported as the file's error
        if isinstance(exc, ModelFileError):
            raise
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
    loss_fn = getattr(module, names["loss_fn"], None)
    if loss_fn is None and names["loss_fn"] != DEFAULT_NAMES["loss_fn"]:   # asked for by name: must be there
        raise ModelFileError(f"no function `{names['loss_fn']}(output, target)`", file=str(path),
                             field=names["loss_fn"], fix="define it, or leave out --loss-fn for the default loss")
    if loss_fn is not None and not callable(loss_fn):
        raise ModelFileError(f"`{names['loss_fn']}` is a {type(loss_fn).__name__}, not a function", file=str(path),
                             field=names["loss_fn"], fix="define `def loss_fn(output, target)` returning a scalar")
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    return ModelFile(p, module, build, batch, loss_fn or default_loss, digest, time_limit_s)


def example_batch(model_file: ModelFile, batch_size: int) -> tuple[tuple[Any, ...], Any]:
    """Call the file's batch() and check its shape: (tuple of inputs, target)."""
    try:
        with user_code(str(model_file.path), f"batch({batch_size}, 0)", model_file.time_limit_s, field="batch"):
            return example_batch_for_step(model_file, batch_size, 0)
    except ModelFileError:
        raise
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
        with user_code(str(model_file.path), "model()", model_file.time_limit_s, field="model"), \
                torch.device("meta"):
            module = model_file.build()
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"model() failed on the meta device: {type(exc).__name__}: {exc}",
                             file=str(model_file.path), field="model",
                             fix="build layers with torch.nn only; no weight loading or .to(device) calls") from exc
    if not isinstance(module, nn.Module):
        raise ModelFileError(f"model() returned {type(module).__name__}, not an nn.Module",
                             file=str(model_file.path), field="model", fix="return an nn.Module")
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelFileError("model() has no trainable parameters: there is nothing to train",
                             file=str(model_file.path), field="model",
                             fix="build layers with parameters (nn.Linear, ...), not frozen ones")
    return module


def to_device(value: Any, device: str | torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def describe(value: Any) -> str:
    """Tensors as `float32[2, 16]`, tuples element-wise: what a message says of an input or an output."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return type(value).__name__


def _rows_signature(value: Any, batch_size: int, what: str,
                    required: bool = True) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape without the row dimension) of each tensor in `value` (a tensor, or a tuple or list:
    what the program cuts into rows); raises ValueError naming `what` when one does not have `batch_size`
    rows, or when `required` and there is no tensor."""
    if isinstance(value, torch.Tensor):
        leaves = [value]
    else:
        leaves = [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (tuple, list)) else []
    if required and not leaves:
        raise ValueError(f"{what} holds no tensor")
    out = []
    for t in leaves:
        if t.dim() == 0 or t.shape[0] != batch_size:
            raise ValueError(f"{what}: {describe(t)} does not have {batch_size} rows (its first dimension)")
        out.append((t.dtype, tuple(t.shape[1:])))
    return out


def check_batch_rows(model_file: ModelFile, batch_size: int, inputs: tuple[Any, ...], target: Any) -> None:
    """`batch(B, k)` returns B rows: check the traced batch (`inputs`, `target` of `batch_size` rows) and
    one of another size, which must hold the same tensors with the same types (a batch() that ignores
    its batch_size would train every replica on the wrong rows)."""
    other = batch_size + 1
    try:
        traced = (_rows_signature(inputs, batch_size, "the inputs"),
                  _rows_signature(target, batch_size, "the target", required=False))
        more_inputs, more_target = example_batch(model_file, other)
        again = (_rows_signature(more_inputs, other, "the inputs"),
                 _rows_signature(more_target, other, "the target", required=False))
    except ValueError as exc:
        raise ModelFileError(f"batch(batch_size, step) must return batch_size rows: {exc}",
                             file=str(model_file.path), field="batch",
                             fix="return tensors whose first dimension is batch_size, for any batch_size") from exc
    if again != traced:
        raise ModelFileError(f"batch({batch_size}, 0) returned {describe((inputs, target))} but batch({other}, 0) "
                             f"returned {describe((more_inputs, more_target))}", file=str(model_file.path),
                             field="batch", fix="return the same tensors for every batch_size, only more rows")


def check_loss(model_file: ModelFile, output: Any, target: Any) -> None:
    """Call the loss on the traced output and target (meta tensors): it must return a scalar tensor."""
    name = getattr(model_file.loss_fn, "__name__", "loss_fn")
    call = f"{name}(output, target)"
    where = f"on the traced output {describe(output)} and target {describe(target)}"
    try:
        with user_code(str(model_file.path), call, model_file.time_limit_s, field=name), torch.no_grad():
            loss = model_file.loss_fn(output, target)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{call} failed {where}: {type(exc).__name__}: {str(exc)[:300]}",
                             file=str(model_file.path), field=name,
                             fix="take the model's output and batch()'s target; return their mean loss") from exc
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        got = describe(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelFileError(f"{call} returned {got} {where}, not a scalar tensor", file=str(model_file.path),
                             field=name, fix="return one number: the mean loss over the batch's rows, as a tensor")
