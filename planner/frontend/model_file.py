"""Load a user's model file and check its contract.

The model file contract (see README): `model() -> nn.Module`, `batch(batch_size, step) ->
(inputs, target)`, optional `loss_fn(output, target)`, optional `dataset()`: a map-style dataset
(`__len__`, `__getitem__`) whose sample i is one row `(inputs..., target)`, each tensor without the
batch dimension; where it is defined the program trains on its rows (backends/torchdist/program/data.py)
and batch() only stands for them in planning. Planning checks it where it can before the search: the
model has trainable parameters, `batch(B, k)` returns B rows (at two sizes, so a `batch()` that
ignores B is caught), the dataset's rows stacked have batch()'s dtypes and shapes (so the trace on
batch() is the trace of the real rows), it holds at least one global batch (`check_dataset`),
`loss_fn` returns a scalar on the traced output. The file's code runs under planner.frontend.user_code
(a time limit; its exits reported as its errors).
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
from torch.utils.data import default_collate

from planner.core.errors import ModelFileError
from planner.frontend.user_code import user_code

DEFAULT_NAMES = {"model": "model", "batch": "batch", "loss_fn": "loss_fn", "dataset": "dataset"}
DATASET_CHECK_ROWS = 2     # samples of dataset() stacked and compared with batch() at planning


@dataclass
class ModelFile:
    """A loaded model file: its module and the contract functions (`dataset`: None where not defined)."""

    path: Path
    module: ModuleType
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[tuple[Any, ...], Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    digest: str
    time_limit_s: float | None = None     # for each call into the file's code (None: no limit)
    dataset: Callable[[], Any] | None = None   # map-style dataset of rows (inputs..., target); None: batch()


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
    dataset = _dataset_function(module, names["dataset"], str(path))
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    return ModelFile(p, module, build, batch, loss_fn or default_loss, digest, time_limit_s, dataset)


def _dataset_function(module: ModuleType, name: str, file: str) -> Callable[[], Any] | None:
    """The file's optional `dataset()`: None when absent under its default name; an error when it was asked
    for under another name and is absent, or when the name holds something that is not a function."""
    value = getattr(module, name, None)
    if value is None and name != DEFAULT_NAMES["dataset"]:
        raise ModelFileError(f"no function `{name}()`", file=file, field=name,
                             fix="define it, or leave out --dataset-fn to train on batch()")
    if value is not None and not callable(value):
        raise ModelFileError(f"`{name}` is a {type(value).__name__}, not a function", file=file, field=name,
                             fix="define `def dataset()` returning a map-style torch.utils.data.Dataset")
    return value


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
    its batch_size would train every replica on the wrong rows). Where the file defines dataset(), its
    first rows stacked must be the same tensors as batch()'s: the trace on batch() stands for them."""
    other = batch_size + 1
    traced: tuple[list[tuple[torch.dtype, tuple[int, ...]]], ...]
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
    if model_file.dataset is not None:
        _check_dataset_rows(model_file, batch_size, (inputs, target), traced)


def _dataset_name(model_file: ModelFile) -> str:
    return getattr(model_file.dataset, "__name__", DEFAULT_NAMES["dataset"])


def load_dataset(model_file: ModelFile) -> Any:
    """Call the file's dataset() and check it is a map-style dataset (`__len__`, `__getitem__`); returns it.
    Raises ModelFileError (also when the file defines no dataset())."""
    name, file = _dataset_name(model_file), str(model_file.path)
    fix = "return a map-style torch.utils.data.Dataset (__len__ and __getitem__) of (inputs..., target) rows"
    if model_file.dataset is None:
        raise ModelFileError("the model file defines no dataset()", file=file, field=name, fix=fix)
    try:
        with user_code(file, f"{name}()", model_file.time_limit_s, field=name):
            data = model_file.dataset()
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{name}() failed: {type(exc).__name__}: {str(exc)[:300]}", file=file, field=name,
                             fix="make dataset() return without error (its data file readable and valid)") from exc
    if not all(callable(getattr(type(data), method, None)) for method in ("__len__", "__getitem__")):
        raise ModelFileError(f"{name}() returned a {type(data).__name__}, without __len__ and __getitem__",
                             file=file, field=name, fix=fix)
    return data


def dataset_length(model_file: ModelFile, data: Any) -> int:
    """`len(data)` of the file's dataset, as the model file's code (a failure is its error)."""
    name, file = _dataset_name(model_file), str(model_file.path)
    try:
        with user_code(file, f"len({name}())", model_file.time_limit_s, field=name):
            return int(len(data))
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"len({name}()) failed: {type(exc).__name__}: {str(exc)[:300]}", file=file, field=name,
                             fix="give the dataset a __len__ returning its number of samples") from exc


def stack_samples(samples: list[Any]) -> tuple[tuple[Any, ...], Any]:
    """Samples `(inputs..., target)` (one row each) stacked into rows like batch() returns them:
    (tuple of inputs, target), each with the row dimension first (torch's default_collate: tensors,
    numpy arrays and numbers are stacked)."""
    stacked = default_collate(samples)
    return tuple(stacked[:-1]), stacked[-1]


def check_dataset_length(model_file: ModelFile, length: int, global_batch: int) -> None:
    """One step reads one global batch of distinct samples: the dataset must hold at least that many."""
    if length < global_batch:
        raise ModelFileError(f"{_dataset_name(model_file)}() holds {length} samples, fewer than one global batch "
                             f"of {global_batch}", file=str(model_file.path), field=_dataset_name(model_file),
                             fix=f"give it at least {global_batch} samples"
                                 + (f", or plan with --global-batch {length} or less" if length else ""))


def check_dataset(model_file: ModelFile, global_batch: int) -> None:
    """Planning's check of a dataset() against the global batch: it holds at least one global batch (its
    rows' structure is checked beside batch()'s, in check_batch_rows). No dataset(): nothing to check."""
    if model_file.dataset is not None:
        data = load_dataset(model_file)
        check_dataset_length(model_file, dataset_length(model_file, data), global_batch)


def _check_dataset_rows(model_file: ModelFile, batch_size: int, traced_batch: tuple[tuple[Any, ...], Any],
                        traced: tuple[list[tuple[torch.dtype, tuple[int, ...]]], ...]) -> None:
    """The first samples of dataset() stacked must have batch()'s tensors (count, dtypes, shapes per row):
    planning traces and costs the model on batch(), the program trains it on the dataset's rows."""
    name, file = _dataset_name(model_file), str(model_file.path)
    data = load_dataset(model_file)
    length = dataset_length(model_file, data)
    if length == 0:
        raise ModelFileError(f"{name}() holds no samples", file=file, field=name,
                             fix="point it at a data file with at least one global batch of samples")
    rows = min(DATASET_CHECK_ROWS, length)
    fix = (f"return samples (inputs..., target): one row of batch()'s tensors each, without the batch "
           f"dimension, as batch({batch_size}, 0) returns {describe(traced_batch)}")
    try:
        with user_code(file, f"{name}()[0..{rows - 1}]", model_file.time_limit_s, field=name):
            samples = [data[i] for i in range(rows)]
        if not isinstance(samples[0], (tuple, list)) or len(samples[0]) < 2:
            raise ValueError(f"sample 0 is {describe(samples[0])}, not (inputs..., target)")
        inputs, target = stack_samples(samples)
        got = (_rows_signature(inputs, rows, "its inputs"), _rows_signature(target, rows, "its target",
                                                                             required=False))
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{name}()'s samples 0..{rows - 1}: {type(exc).__name__}: {str(exc)[:300]}",
                             file=file, field=name, fix=fix) from exc
    if got != traced:
        raise ModelFileError(f"{name}()'s samples 0..{rows - 1} stacked are {describe((inputs, target))}, not the "
                             f"tensors of batch()", file=file, field=name, fix=fix)


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
