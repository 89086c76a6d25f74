"""What a rank's communication is derived from besides the plan: each replica's stage split at each of
its micro-batch sizes (which values cross which boundary, in which order, of which shape) and the
gradient groups' parameters (element counts and dtypes: the all-reduce and bucket sizes).

The planner takes them from traces of the model on meta tensors (`trace_splits`, then `traced_inputs`;
`trace_inputs` does both), the program from its own split of the real model
(backends/torchdist/program/comm_check.py), and a plan's `comm` record keeps the planner's (`to_record` /
`from_record`), so that either side derives its streams with one function.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from passes.split import StageSplit, split_stages
from planner import frontend
from planner.core.comm_records import CommRecord, CommSplit, CommValue
from planner.core.errors import PassError
from planner.core.ir import Plan


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SplitView:
    """What the streams need of a StageSplit: its values and each stage's inputs and outputs, in order."""

    values: Mapping[str, CommValue]
    stage_inputs: tuple[tuple[str, ...], ...]
    stage_outputs: tuple[tuple[str, ...], ...]

    @staticmethod
    def of(split: StageSplit) -> SplitView:
        values = {name: CommValue(name, v.producer, tuple(v.consumers), tuple(int(d) for d in v.shape),
                                  dtype_name(v.dtype), bool(v.needs_grad))
                  for name, v in split.values.items()}
        return SplitView(values, tuple(tuple(s.inputs) for s in split.stages),
                         tuple(tuple(s.outputs) for s in split.stages))


@dataclass(frozen=True)
class StreamInputs:
    """Splits by (replica, micro-batch rows), parameters by name: (elements, dtype)."""

    splits: Mapping[tuple[int, int], SplitView]
    params: Mapping[str, tuple[int, str]]

    def split(self, replica: int, rows: int) -> SplitView:
        try:
            return self.splits[replica, rows]
        except KeyError:
            raise PassError(f"no stage split of replica {replica} at micro-batch size {rows} to derive "
                            "its communication from", fix="report this plan") from None

    def param(self, name: str) -> tuple[int, str]:
        try:
            return self.params[name]
        except KeyError:
            raise PassError(f"gradient-group parameter {name} is not a parameter of the model",
                            field="grad_groups.params", fix="re-plan with this model file") from None


def param_table(named: Iterable[tuple[str, Any]]) -> dict[str, tuple[int, str]]:
    """(name, tensor-like with shape and dtype) pairs -> name: (elements, dtype)."""
    return {name: (math.prod(int(d) for d in value.shape), dtype_name(value.dtype)) for name, value in named}


def model_params(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Every parameter under every name it has (a tied weight under each: the graph may read either)."""
    return param_table(model.named_parameters(remove_duplicate=False))


def graph_params(gm: fx.GraphModule) -> dict[str, tuple[int, str]]:
    """The parameters a traced graph reads (get_attr nodes with a tensor value)."""
    return param_table((str(n.target), n.meta["val"]) for n in gm.graph.nodes
                       if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor))


def cut_points(plan: Plan) -> dict[tuple[str, ...], list[int]]:
    """Each distinct stage split of the plan (its stages' last nodes) -> the replicas cut so."""
    cuts: dict[tuple[str, ...], list[int]] = {}
    for r in plan.replicas:
        cuts.setdefault(tuple(s.last_node for s in r.stages), []).append(r.index)
    return cuts


def stage_splits(plan: Plan, graph_at: Any) -> dict[tuple[int, int], StageSplit]:
    """Every replica's StageSplit at each of its micro-batch sizes, by (replica, rows); `graph_at(rows)`
    gives the model traced at that size (called once per size). Replicas cut alike share one split."""
    cuts = cut_points(plan)
    splits: dict[tuple[int, int], StageSplit] = {}
    for rows in sorted({m for r in plan.replicas for m in r.micro_batch_sizes}):
        gm = graph_at(rows)
        for last_nodes, replicas in cuts.items():
            users = [i for i in replicas if rows in plan.replicas[i].micro_batch_sizes]
            if users:
                split = split_stages(gm, list(last_nodes))
                splits.update({(i, rows): split for i in users})
    return splits


def views_of(splits: Mapping[tuple[int, int], StageSplit], params: Mapping[str, tuple[int, str]]) -> StreamInputs:
    """StreamInputs of stage splits by (replica, rows): one view per distinct split."""
    views: dict[int, SplitView] = {}
    for split in splits.values():
        views.setdefault(id(split), SplitView.of(split))
    return StreamInputs({key: views[id(split)] for key, split in splits.items()}, dict(params))


def split_inputs(plan: Plan, graph_at: Any, params: Mapping[str, tuple[int, str]]) -> StreamInputs:
    """StreamInputs of every replica at each of its micro-batch sizes; `graph_at(rows)` gives the model
    traced at that size (called once per size)."""
    return views_of(stage_splits(plan, graph_at), params)


def trace_splits(plan: Plan, model_file: frontend.ModelFile, gm: fx.GraphModule,
                 trace_batch: int) -> dict[tuple[int, int], StageSplit]:
    """The planner's stage splits: the model traced on meta at each micro-batch size of the plan (`gm` is
    its trace at `trace_batch`), split like each replica, by (replica, rows). The communication is derived
    from them (`traced_inputs`), and each of their stages is run once (passes.stage_check)."""
    traced = {trace_batch: gm}

    def graph_at(rows: int) -> fx.GraphModule:
        if rows not in traced:
            traced[rows] = frontend.trace_model(model_file, rows)[0]
        return traced[rows]

    return stage_splits(plan, graph_at)


def traced_inputs(plan: Plan, splits: Mapping[tuple[int, int], StageSplit], gm: fx.GraphModule) -> StreamInputs:
    """The planner's StreamInputs from its stage splits (`trace_splits`); of the parameters of `gm` only
    the gradient groups' are kept."""
    grouped = {p for g in plan.grad_groups for p in g.params}
    return views_of(splits, {k: v for k, v in graph_params(gm).items() if k in grouped})


def trace_inputs(plan: Plan, model_file: frontend.ModelFile, gm: fx.GraphModule, trace_batch: int) -> StreamInputs:
    """The planner's StreamInputs: the model traced on meta at each micro-batch size (`gm` is its trace at
    `trace_batch`), split like each replica. Only the gradient groups' parameters are kept."""
    return traced_inputs(plan, trace_splits(plan, model_file, gm, trace_batch), gm)


def to_record(plan: Plan, inputs: StreamInputs, digests: tuple[str, ...]) -> CommRecord:
    """The plan's `comm` record: the inputs (each distinct split once) and the digests."""
    splits: list[CommSplit] = []
    for replica in plan.replicas:
        for rows in sorted(set(replica.micro_batch_sizes)):
            view = inputs.split(replica.index, rows)
            for i, s in enumerate(splits):
                if s.rows == rows and _view(s) == view:
                    splits[i] = CommSplit(s.replicas + (replica.index,), rows, s.values, s.stage_inputs,
                                          s.stage_outputs)
                    break
            else:
                splits.append(CommSplit((replica.index,), rows, tuple(view.values[k] for k in sorted(view.values)),
                                        view.stage_inputs, view.stage_outputs))
    params = tuple((name, numel, dtype) for name, (numel, dtype) in sorted(inputs.params.items()))
    return CommRecord(tuple(splits), params, digests)


def _view(s: CommSplit) -> SplitView:
    return SplitView({v.name: v for v in s.values}, s.stage_inputs, s.stage_outputs)


def from_record(record: CommRecord) -> StreamInputs:
    """StreamInputs as the planner derived them, from a plan's `comm` record."""
    splits = {(replica, s.rows): _view(s) for s in record.splits for replica in s.replicas}
    return StreamInputs(splits, {name: (numel, dtype) for name, numel, dtype in record.params})
