"""What tensor parallelism does to a block of nodes, in the numbers the planner costs.

For a set of node names (a block of passes.blocks, or a stage): the parameter bytes that shard and those
that stay replicated, the fraction of the block's matmul FLOPs that shard (linear: 2*in*out*rows;
attention: 4*batch*heads*q*k*head_dim; matmul/bmm: 2*m*k*n per batch), and the all-reduce bytes per
sample of the regions whose row linears lie in the block, forward (g) and backward (f). Shapes are the
traced ones (node.meta["val"]); FLOPs of other ops are ignored (they are small beside the matmuls).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from .layout import TPLayout
from .rules import op_name


@dataclass(frozen=True)
class TPBlockCost:
    sharded_param_bytes: int
    replicated_param_bytes: int
    sharded_flop_fraction: float          # of the block's matmul FLOPs; 0.0 for a block without any
    fwd_allreduce_bytes_per_sample: int
    bwd_allreduce_bytes_per_sample: int


def _val(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def matmul_flops(node: fx.Node) -> int:
    """Forward FLOPs of a linear, an attention or a matmul node (0 for anything else)."""
    name, out = op_name(node), _val(node)
    inputs = [_val(a) if isinstance(a, fx.Node) else None for a in node.args[:2]]
    if out is None or not inputs or inputs[0] is None:
        return 0
    if name == "linear" and inputs[1] is not None:
        return 2 * inputs[1].shape[1] * out.numel()
    if name == "scaled_dot_product_attention" and inputs[1] is not None:
        q, k = inputs[0], inputs[1]
        return 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    if name in ("matmul", "bmm"):
        return 2 * inputs[0].shape[-1] * out.numel()
    return 0


def block_cost(gm: fx.GraphModule, layout: TPLayout, names: Iterable[str]) -> TPBlockCost:
    """The tensor-parallel view of the nodes `names` of `gm` (the graph `layout` was found in, unsharded)."""
    wanted = set(names)
    nodes = [n for n in gm.graph.nodes if n.name in wanted]
    specs = layout.specs()
    params = {a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}
    params |= {n for n in nodes if n.op == "get_attr"}
    sharded = sum(_bytes(v) for p in params if str(p.target) in specs and (v := _val(p)) is not None)
    replicated = sum(_bytes(v) for p in params if str(p.target) not in specs and (v := _val(p)) is not None)
    in_region = {name for region in layout.regions for name in region.nodes}
    total = sum(matmul_flops(n) for n in nodes)
    shard = sum(matmul_flops(n) for n in nodes if n.name in in_region)
    fwd = bwd = 0
    by_name = {n.name: n for n in gm.graph.nodes}
    for region in layout.regions:
        if any(row in wanted for row in region.rows):
            item = max(v.element_size() for row in region.rows if (v := _val(by_name[row])) is not None)
            fwd += region.fwd_allreduce_elems_per_sample * item
            bwd += region.bwd_allreduce_elems_per_sample * item
    return TPBlockCost(sharded, replicated, shard / total if total else 0.0, fwd, bwd)
