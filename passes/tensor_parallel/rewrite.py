"""Rewrite a traced graph in place to run one shard of tensor-parallel degree t (lowering).

For each region of the layout: every value entering the region goes through `copy_to_tp_region`
(right before its first use there, so a pipeline cut before the region sends the replicated value
only); every row linear drops its bias, its partial output goes through `reduce_from_tp_region`, and the
bias is added after; the concrete sizes of views, expands and splits become local sizes; node.meta["val"]
of the region's values get their local shapes (what passes.split reports for a value crossing a cut);
the graph's sharded parameters become rank `index`'s shards of what the graph holds (meta stays meta:
the program installs the real shards later, see `local_parameters`). Degree 1 changes nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from planner.core.errors import PassError

from .collectives import TP_GROUP_ATTR, TPGroup, copy_to_tp_region, reduce_from_tp_region
from .layout import ShardSpec, TPLayout, TPRegion, shard_tensor
from .rules import arg_ints


def _owner(gm: fx.GraphModule, target: str) -> tuple[nn.Module, str]:
    *path, leaf = target.split(".")
    module: nn.Module = gm
    for part in path:
        module = getattr(module, part)
    return module, leaf


def _local_val(value: Any, dim: int, degree: int) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_local_val(v, dim, degree) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    sizes = list(value.shape)
    sizes[dim] //= degree
    return torch.empty(sizes, dtype=value.dtype, device="meta")


def _shard_parameter(gm: fx.GraphModule, spec: ShardSpec, degree: int, index: int) -> None:
    module, leaf = _owner(gm, spec.name)
    full = getattr(module, leaf)
    local = shard_tensor(full.detach(), spec, degree, index)
    setattr(module, leaf, nn.Parameter(local, requires_grad=full.requires_grad))


def _rewrite_region(gm: fx.GraphModule, region: TPRegion, degree: int, group: fx.Node) -> None:
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    members = {by_name[name] for name in region.nodes}
    for name in region.inputs:
        value = by_name[name]
        users = sorted((u for u in value.users if u in members), key=order.__getitem__)
        with graph.inserting_before(users[0]):
            copied = graph.call_function(copy_to_tp_region, (value, group))
        copied.meta["val"] = value.meta.get("val")
        for user in users:
            user.replace_input_with(value, copied)
    for rewrite in region.rewrites:
        node = by_name[rewrite.node]
        args = list(node.args)
        if rewrite.item is None:
            args[rewrite.arg] = rewrite.full // degree
        else:
            sizes = arg_ints(node, rewrite.arg)
            sizes[rewrite.item] = rewrite.full // degree
            args[rewrite.arg] = sizes
        node.args = tuple(args)
    for name, dim in zip(region.nodes, region.local_dims):
        if dim is not None:
            by_name[name].meta["val"] = _local_val(by_name[name].meta.get("val"), dim, degree)
    for name in region.rows:
        row = by_name[name]
        bias = row.args[2] if len(row.args) > 2 else None
        row.args = row.args[:2]
        with graph.inserting_after(row):
            summed = graph.call_function(reduce_from_tp_region, (row, group))
        summed.meta["val"] = row.meta.get("val")
        result = summed
        if isinstance(bias, fx.Node):
            with graph.inserting_after(summed):
                result = graph.call_function(torch.ops.aten.add.Tensor, (summed, bias))
            result.meta["val"] = row.meta.get("val")
        row.replace_all_uses_with(result, delete_user_cb=lambda user, reduce=summed: user is not reduce)
        # the summed value takes the row's name: a stage cut after the row (a plan's last_node) cuts after the
        # sum, and the value the cut sends keeps the name the planner verified
        row._rename(f"{name}_partial")
        graph._graph_namespace._used_names.discard(name)     # free the name for the sum (fx keeps it reserved)
        result._rename(name)
        if result.name != name:
            raise PassError(f"tensor parallelism could not keep the name of `{name}` for its summed output",
                            field="tensor_parallel", fix="report this model")


def shard_graph(gm: fx.GraphModule, layout: TPLayout, degree: int, index: int, group: Any) -> None:
    """Rewrite `gm` (the graph `layout` was found in) to compute rank `index`'s shard of degree `degree`,
    with collectives on `group` (the TP ranks' ProcessGroup); recompiles `gm`."""
    if degree < 1 or not 0 <= index < degree:
        raise PassError(f"tensor-parallel rank {index} of degree {degree} is out of range",
                        field="tensor_parallel.degree", fix="use a degree >= 1 and a rank below it")
    if not layout.divides(degree):
        raise PassError(f"tensor-parallel degree {degree} does not divide every sharded size (heads, KV heads, "
                        f"hidden sizes)", field="tensor_parallel.degree",
                        fix=f"use one of the degrees {layout.degrees(max(degree, layout.max_degree))}")
    if degree == 1 or not layout.regions:
        return
    setattr(gm, TP_GROUP_ATTR, TPGroup(group))
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # FX expects get_attr of tensors and modules only
        group_node = gm.graph.get_attr(TP_GROUP_ATTR)
    by_target = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    for region in layout.regions:
        _rewrite_region(gm, region, degree, group_node)
        for spec in region.params:
            _shard_parameter(gm, spec, degree, index)
            node = by_target[spec.name]
            node.meta["val"] = _local_val(node.meta.get("val"), spec.dim, degree)
    gm.graph.lint()
    gm.recompile()


def local_parameters(values: dict[str, torch.Tensor], layout: TPLayout, degree: int,
                     index: int) -> dict[str, torch.Tensor]:
    """`values` (qualified name -> full tensor) with every sharded parameter replaced by rank `index`'s
    shard: what the program installs into a rewritten graph (Parameters stay Parameters)."""
    specs = layout.specs()
    out: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if name in specs and degree > 1:
            local = shard_tensor(value.detach(), specs[name], degree, index)
            out[name] = nn.Parameter(local, requires_grad=value.requires_grad) if isinstance(
                value, nn.Parameter) else local
        else:
            out[name] = value
    return out
