"""Annotate: shapes, dtypes, FLOPs (fwd/bwd), bytes, parameter and activation sizes on node.meta.

Writes typed records under named keys: `node.meta["val"]` (a meta tensor, as torch.export does) and
`node.meta[COST_KEY]` (`costmodel.ops.OpCount`); get_attr nodes get `node.meta[PARAM_BYTES_KEY]`.
A matmul or convolution that reads a trainable weight (directly or through views: `t(weight)`) records
its weight gradient's FLOPs, its forward's again, as `wgrad_flops`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from costmodel.ops import OpCounter, tensor_bytes
from passes.base import Pass, PassResult
from planner.core.blocks import OpCount
from planner.core.errors import PassError

COST_KEY = "hetplan.cost"
PARAM_BYTES_KEY = "hetplan.param_bytes"


def _val(node: Any) -> Any:
    if isinstance(node, fx.Node):
        return node.meta.get("val")
    return node


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _reads_weight(node: fx.Node) -> bool:
    """`node` is a trainable parameter, or a view of one (a linear's transposed weight)."""
    while True:
        if node.op == "get_attr":
            return bool(getattr(node.meta.get("val"), "requires_grad", False))
        cost = node.meta.get(COST_KEY)
        if not (isinstance(cost, OpCount) and cost.op_class == "view") or not node.all_input_nodes:
            return False
        node = node.all_input_nodes[0]


class MetaShapes(Pass):
    """Fill `node.meta["val"]` by running the graph on meta tensors (for symbolic_trace graphs)."""

    name = "meta_shapes"

    def __init__(self, example_inputs: tuple[Any, ...]) -> None:
        self.example_inputs = example_inputs

    def call(self, gm: fx.GraphModule) -> PassResult:
        if all("val" in n.meta for n in gm.graph.nodes if n.op != "output"):
            return PassResult(gm, False)
        to_meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
        interp = fx.Interpreter(gm)
        env_inputs = tree_map(to_meta, self.example_inputs)
        it = iter(env_inputs)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                node.meta["val"] = next(it)
            elif node.op == "get_attr":
                node.meta["val"] = _fetch_attr(gm, node.target)
            elif node.op != "output":
                args = tree_map(_val, node.args)
                kwargs = tree_map(_val, node.kwargs)
                node.meta["val"] = getattr(interp, node.op)(node.target, args, kwargs)
        return PassResult(gm, True)


class Annotate(Pass):
    """Count every call node's FLOPs and bytes; record parameter bytes on get_attr nodes."""

    name = "annotate"

    def __init__(self, counter: OpCounter | None = None) -> None:
        self.counter = counter or OpCounter()

    def requires(self, gm: fx.GraphModule) -> None:
        missing = [n.name for n in gm.graph.nodes if n.op not in ("output",) and "val" not in n.meta]
        if missing:
            raise PassError(f"annotate needs node.meta['val'] (missing on {missing[:3]})",
                            fix="run MetaShapes first")

    def call(self, gm: fx.GraphModule) -> PassResult:
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                node.meta[PARAM_BYTES_KEY] = tensor_bytes(node.meta["val"])
            elif node.op in ("call_function", "call_method", "call_module"):
                args = fx.map_arg(node.args, _val)
                kwargs = fx.map_arg(node.kwargs, _val)
                target = node.target
                if node.op == "call_module":
                    target = _fetch_attr(gm, node.target)
                cost = self.counter.count(target, args, kwargs, node.meta["val"])
                if cost.op_class in ("matmul", "conv") and any(_reads_weight(a) for a in node.all_input_nodes):
                    cost = dataclasses.replace(cost, wgrad_flops=min(cost.fwd_flops, cost.bwd_flops))
                node.meta[COST_KEY] = cost
        return PassResult(gm, True)

    def ensures(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if node.op.startswith("call") and not isinstance(node.meta.get(COST_KEY), OpCount):
                raise PassError(f"node {node.name} left without a cost record", fix="report this")
