"""Export each distinct stage of a plan to ONNX with the dynamo exporter; check it in onnxruntime.

A stage is exported as its own module (the FX graph passes.split cut out of the traced model), not the
whole model: the values crossing its boundaries become the ONNX graph's inputs and outputs under the
plan's names, its parameters and buffers initializers. onnxruntime then runs the file on the very
tensors the torch stage read, and the largest absolute difference from the torch stage's outputs is
the file's figure (integer and boolean outputs must be equal; a differing one counts as infinite).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.onnx.stages import PlanStage, plan_stages
from planner import frontend
from planner.core.errors import HetplanError, ModelFileError, PassError
from planner.core.ir import Plan

DEFAULT_TOLERANCE = 1e-4      # max abs difference accepted between onnxruntime and torch (fp32)
PACKAGES = ("onnx", "onnxscript", "onnxruntime")   # the `onnx` extra: the dynamo exporter needs onnxscript
_OP = re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)|target=torch\.ops\.([\w.]+)")


@dataclass(frozen=True)
class StageFile:
    """One exported stage: where it is, what it reads and writes, and how closely it matches torch."""

    stage: int
    replicas: tuple[int, ...]
    rows: int
    path: Path
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int
    max_abs_diff: float
    size_bytes: int


def export_plan(plan: Plan, model_file: frontend.ModelFile, out_dir: Path, *, plan_file: str, seed: int = 0,
                micro_batch: int | None = None, opset: int | None = None) -> list[StageFile]:
    """Write `out_dir/stage<k>_replica<r>.onnx` for each distinct stage of `plan` (r: the first replica
    running it) and check each in onnxruntime; returns them in replica then stage order. Raises
    ModelFileError naming the stage and the operator the exporter cannot translate."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise HetplanError(f"exporting ONNX stages needs the package(s) {', '.join(missing)}",
                           fix="pip install 'hetplan[onnx]'")
    files = []
    for stage in plan_stages(plan, model_file, plan_file=plan_file, seed=seed, micro_batch=micro_batch):
        path = out_dir / f"stage{stage.index}_replica{stage.replicas[0]}.onnx"
        export_stage(stage, path, file=str(model_file.path), opset=opset)
        diff = max_abs_diff(stage, path)
        files.append(StageFile(stage.index, stage.replicas, stage.rows, path, tuple(stage.graph.inputs),
                               stage.output_names, _opset_of(path), diff, _size_bytes(path)))
    return files


def export_stage(stage: PlanStage, path: Path, *, file: str, opset: int | None = None) -> None:
    """`torch.onnx.export(..., dynamo=True)` of one stage's module on its traced inputs, saved at `path`."""
    module = stage.graph.module
    module.eval()   # an aten graph runs the same either way; eval() only spares the exporter's training warning
    try:
        with _quiet():
            program = torch.onnx.export(module, stage.inputs, dynamo=True, input_names=list(stage.graph.inputs),
                                        output_names=list(stage.output_names), opset_version=opset,
                                        verbose=False)
    except Exception as exc:   # the exporter's errors are pages long: name the stage and the operator
        raise ModelFileError(f"stage {stage.index} ({_replicas(stage.replicas)}) does not export to ONNX: "
                             f"{_failed_op(exc)}", file=file, field="model",
                             fix="use an operator ONNX has, or register a translation for it "
                                 "(torch.onnx.export's custom_translation_table)") from exc
    if program is None:
        raise PassError(f"stage {stage.index}: torch.onnx.export returned no program", fix="report this")
    with _quiet():
        program.save(str(path))


def max_abs_diff(stage: PlanStage, path: Path) -> float:
    """The largest |onnxruntime - torch| over the stage's outputs, run on the torch stage's own inputs."""
    import onnxruntime as ort  # the check's own dependency, loaded when a check runs

    options = ort.SessionOptions()
    options.log_severity_level = 3        # errors only: its graph-optimisation notes are not the user's
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    by_name = dict(zip(stage.graph.inputs, stage.inputs))
    missing = [i.name for i in session.get_inputs() if i.name not in by_name]
    if missing:
        raise PassError(f"stage {stage.index}: the ONNX file reads {missing}, which the stage does not",
                        fix="report this with the model file")
    feeds = {i.name: by_name[i.name].detach().cpu().numpy() for i in session.get_inputs()}
    results = session.run(list(stage.output_names), feeds)
    return max((_difference(expected, got) for expected, got in zip(stage.outputs, results)), default=0.0)


def _difference(expected: torch.Tensor, got: np.ndarray) -> float:
    want = expected.detach().cpu().numpy()
    if want.shape != got.shape:
        return math.inf
    if not (np.issubdtype(want.dtype, np.floating) or np.issubdtype(want.dtype, np.complexfloating)):
        return 0.0 if np.array_equal(want, got) else math.inf
    if want.size == 0:
        return 0.0
    both_nan = np.isnan(want) & np.isnan(got)
    diff = np.where(both_nan, 0.0, np.abs(want.astype(np.float64) - got.astype(np.float64)))
    return math.inf if np.isnan(diff).any() else float(diff.max())


def _failed_op(exc: BaseException) -> str:
    """The operator named in the exporter's error chain (`aten._linalg_eigh.default`), with the
    exporter's reason in a few words; else the first line of its error."""
    texts: list[str] = []
    link: BaseException | None = exc
    while link is not None and len(texts) < 8:
        texts.append(str(link))
        link = link.__cause__ or link.__context__
    joined = "\n".join(texts)
    match = _OP.search(joined)
    if match:
        op = f"{match.group(1)}.{match.group(2)}" if match.group(1) else match.group(3)
        reason = "no ONNX translation" if "No ONNX function found" in joined else "its translation failed"
        return f"operator {op}: {reason}"
    first = next((line.strip() for line in joined.splitlines() if line.strip()), type(exc).__name__)
    return first[:300]


def _opset_of(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _size_bytes(path: Path) -> int:
    """The file's bytes, with its external data beside it (models over 2 GiB keep weights apart)."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def _replicas(indices: tuple[int, ...]) -> str:
    return ("replica " if len(indices) == 1 else "replicas ") + ",".join(str(i) for i in indices)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's progress lines, warnings and log records (it warns about torchvision's absence,
    pytree deprecations) are not shown; a failure is reported once, as one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
