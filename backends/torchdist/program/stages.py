"""This rank's stage: the model traced on meta at each of its replica's micro-batch sizes, split like the
plan, and only its own stage's tensors given values.

A traced graph carries its shapes, so each micro-batch size of the replica has its own trace, all made
at start-up on the meta model (materialise.py: no parameter storage), and cut at the plan's node names
by the same lowering pass the planner verified (passes.split). Deep stacks of identical layers are
traced through a few and replicated, as the planner traces them (planner/frontend/repeated.py), so
start-up does not grow with the depth of the model. `install` then puts the rank's real tensors into its
stage module of every split; the other stages stay on meta and never run here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from passes.split import StageSplit, attr_name, split_stages
from passes.tensor_parallel.collectives import TP_GROUP_ATTR
from planner import frontend
from planner.core.errors import ModelFileError

from .materialise import MetaModel


class StageGraphs:
    """The model's stage graphs at each micro-batch size in `sizes`, split after `last_nodes`, to run on
    `device` ("meta": a dry run).

    `meta_inputs(rows)` gives the model's inputs of `rows` rows on the meta device; `shard` rewrites each
    traced graph before it is split (tensor parallelism: the rank's shard of every column/row pair).
    """

    def __init__(self, meta: MetaModel, model_file: frontend.ModelFile, last_nodes: list[str],
                 sizes: Iterable[int], meta_inputs: Callable[[int], tuple[Any, ...]],
                 device: torch.device | str = "meta",
                 shard: Callable[[fx.GraphModule], None] | None = None) -> None:
        self.meta, self.model_file, self.last_nodes, self.shard = meta, model_file, last_nodes, shard
        self._splits: dict[int, StageSplit] = {}
        self._targets: dict[str, str] = {}       # a stage module's attribute -> the model's qualified name
        for rows in sorted(set(sizes)):
            gm = frontend.trace(meta.module, meta_inputs(rows), file=str(model_file.path), replicate_repeated=True)
            on_device(gm, torch.device(device))
            if shard is not None:        # tensor parallelism: this rank's shard of each pair (tensor_parallel.py)
                shard(gm)
            self._targets.update({attr_name(str(n.target)): str(n.target) for n in gm.graph.nodes
                                  if n.op == "get_attr" and str(n.target) != TP_GROUP_ATTR})
            self._splits[rows] = split_stages(gm, last_nodes)

    @property
    def sizes(self) -> list[int]:
        return sorted(self._splits)

    def split_at(self, rows: int) -> StageSplit:
        """The split at micro-batch size `rows` (one the replica trains with)."""
        return self._splits[rows]

    def tensor_names(self, stage: int) -> list[str]:
        """Qualified names of the parameters and buffers stage `stage` reads, at any of the sizes."""
        names: list[str] = []
        for split in self._splits.values():
            for node in split.stages[stage].module.graph.nodes:
                if node.op == "get_attr" and _is_tensor(node):
                    names.append(self._model_name(str(node.target)))
        return list(dict.fromkeys(names))

    def _model_name(self, attr: str) -> str:
        target = self._targets[attr]
        try:
            self.meta.module.get_parameter(target)
            return target
        except AttributeError:
            pass
        if target in self.meta.buffers:
            return target
        raise ModelFileError(f"the traced forward reads a tensor `{target}` that is neither a parameter nor a "
                             "buffer of the model (a constant made in forward())", file=str(self.model_file.path),
                             field="model", fix="register it in __init__ with self.register_buffer(name, tensor)")

    def install(self, stage: int, values: dict[str, torch.Tensor]) -> None:
        """Point stage `stage`'s module of every split at `values` (qualified name -> real tensor)."""
        for split in self._splits.values():
            module = split.stages[stage].module
            for node in module.graph.nodes:
                if node.op != "get_attr" or not _is_tensor(node):
                    continue
                attr = str(node.target)
                value = values[self._model_name(attr)]
                if isinstance(value, nn.Parameter):
                    module.register_parameter(attr, value)
                else:
                    module.register_buffer(attr, value)


def _is_tensor(node: fx.Node) -> bool:
    """A get_attr of a model tensor (not the tensor-parallel group a sharded graph reads)."""
    return attr_name(str(node.target)) != attr_name(TP_GROUP_ATTR) and str(node.target) != TP_GROUP_ATTR


def on_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Retarget a graph traced on meta to `device`: the tracer records the device of the tensors a forward
    creates (`torch.arange(n, device=x.device)` becomes `arange(n, device=meta)`); a trace on the rank's
    device would have recorded that one."""
    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    gm.recompile()


def save_parameters(params: dict[str, nn.Parameter], path: Path) -> Path:
    """Write a rank's parameters (on CPU) to `path`, e.g. out/run/final/rank{r}.pt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({name: p.detach().cpu() for name, p in params.items()}, path)
    return path
