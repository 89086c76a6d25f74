"""Load a user's model file and check its contract.

The model file contract (see README): `model() -> nn.Module`, `batch(batch_size, step) ->
(inputs, target)`, optional `loss_fn(output, target)`.
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
