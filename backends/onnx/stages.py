"""A plan's stages as the emitted program builds them, with the values that flow through them.

The model is built on CPU with the program's initial values (its init contract,
backends/torchdist/program/materialise.py), traced at one
micro-batch size on `batch(rows, 0)` and cut at the plan's stage boundaries by the same lowering pass the
program uses (passes.split). The stages then run in order in torch, so each one has the inputs it reads
(model inputs, values of earlier stages) and the outputs it computes: what the ONNX file of that stage
must reproduce.

Replicas with the same cuts and the same micro-batch size run the very same stages: each such stage is
one `PlanStage`, listing the replicas that share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from backends.torchdist.program import materialise
from passes.split import StageGraph, StageSplit, split_stages
from planner import frontend
from planner.core.errors import ModelFileError, PassError, PlanFileError
from planner.core.ir import Plan, ReplicaPlan
from planner.frontend.user_code import user_code


@dataclass(frozen=True)
class PlanStage:
    """One distinct stage: its graph, and the tensors it reads and writes on the traced micro-batch."""

    index: int                           # position in its pipeline
    replicas: tuple[int, ...]            # the replicas whose pipeline runs exactly this stage
    rows: int                            # the micro-batch size it is traced at
    graph: StageGraph                    # passes.split's stage: module, input and output value names
    inputs: tuple[torch.Tensor, ...]     # in `graph.inputs` order
    outputs: tuple[torch.Tensor, ...]    # in `output_names` order, as the torch stage computes them

    @property
    def output_names(self) -> tuple[str, ...]:
        """The values this stage hands on: to later stages, or (the last stage) the model's outputs."""
        return tuple(self.graph.outputs or self.graph.model_outputs)


def plan_stages(plan: Plan, model_file: frontend.ModelFile, *, plan_file: str, seed: int = 0,
                micro_batch: int | None = None) -> list[PlanStage]:
    """Every distinct stage of `plan`, in replica then stage order; each replica is traced at its first
    micro-batch size, or at `micro_batch` when given. Raises PlanFileError when the plan's cuts are not
    in the model file's graph, ModelFileError when the model file cannot be built or traced."""
    model = _build(model_file, seed)
    groups: dict[tuple[tuple[str, ...], int], list[ReplicaPlan]] = {}
    for replica in plan.replicas:
        rows = micro_batch or replica.micro_batch_sizes[0]
        groups.setdefault((tuple(s.last_node for s in replica.stages), rows), []).append(replica)
    traced: dict[int, tuple[Any, tuple[torch.Tensor, ...]]] = {}
    out: list[PlanStage] = []
    for (cuts, rows), replicas in groups.items():
        if rows not in traced:
            traced[rows] = _trace(model, model_file, rows)
        gm, inputs = traced[rows]
        try:
            split = split_stages(gm, list(cuts))
        except PassError as exc:   # the plan names a node this model's graph does not have: an edited or stale plan
            where = f"replicas[{replicas[0].index}].stages"
            raise PlanFileError(exc.message, file=plan_file, field=f"{where}[*].last_node",
                                fix="re-run `plan` with this model file; do not edit plan.json") from exc
        out.extend(_run_stages(split, inputs, tuple(r.index for r in replicas), rows, str(model_file.path)))
    return out


def _build(model_file: frontend.ModelFile, seed: int) -> nn.Module:
    """The whole model with the values one process trains from (the program's init contract)."""
    return materialise.full_model(model_file, seed)


def _trace(model: nn.Module, model_file: frontend.ModelFile, rows: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """The model's graph at `rows` rows on real tensors, as the program traces it, and its inputs."""
    inputs, _ = frontend.example_batch(model_file, rows)
    with user_code(str(model_file.path), f"tracing model() at {rows} rows", model_file.time_limit_s, field="model"):
        gm = frontend.trace(model, inputs, file=str(model_file.path))
    return gm, tuple(inputs)


def _run_stages(split: StageSplit, model_inputs: tuple[torch.Tensor, ...], replicas: tuple[int, ...], rows: int,
                file: str) -> list[PlanStage]:
    """Run the stages in order in torch, each on what the earlier ones (and the model inputs) give it."""
    if len(split.model_inputs) != len(model_inputs):
        raise ModelFileError(f"the traced graph reads {len(split.model_inputs)} inputs, batch() gives "
                             f"{len(model_inputs)}", file=file, field="batch",
                             fix="return the model's inputs as one tuple of tensors")
    values: dict[str, torch.Tensor] = dict(zip(split.model_inputs, model_inputs))
    out = []
    for stage in split.stages:
        inputs = tuple(values[name] for name in stage.inputs)
        with torch.no_grad():
            result = stage.module(*inputs)
        outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        names = stage.outputs or stage.model_outputs
        values.update(zip(names, outputs))
        out.append(PlanStage(stage.index, replicas, rows, stage, inputs, outputs))
    return out
