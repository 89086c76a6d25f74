"""Find Megatron-style tensor-parallel regions in a traced graph (no per-model tables).

Every `aten.linear` whose weight is a parameter is a candidate column. Its flood is every value that
depends on its output, up to the next linears with parameter weights (the rows, where the flood stops);
a flood that reaches an op without a shard rule (rules.py) or the graph's output rules the candidate
out. Candidates whose floods meet (q, k and v at the attention; gate and up at SwiGLU's product) are one
region. Shard states are then propagated through the region in graph order: a region is kept only where
every op carries its shard, every row's input is sharded on its last dim, and every sharded parameter is
read by the region's linears only (a tied weight stays replicated).

A fused projection (GPT's qkv, out 3*C, followed by `split(C, -1)`) is sharded interleaved: its output's
last dim is read as (k, n/k) with k the number of equal pieces of the split that follows.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn as nn

from .layout import Rejection, ShardSpec, SizeRewrite, TPLayout, TPRegion
from .rules import Shard, State, Unshardable, arg_node, can_carry, op_name, propagate, shape


def is_param_linear(node: fx.Node) -> bool:
    """`aten.linear(x, W[, b])` with W (and b) read from the module (get_attr)."""
    if op_name(node) != "linear" or len(node.args) < 2:
        return False
    weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
    return (isinstance(weight, fx.Node) and weight.op == "get_attr"
            and (bias is None or isinstance(bias, fx.Node) and bias.op == "get_attr"))


def _flood(column: fx.Node) -> tuple[set[fx.Node], set[fx.Node]] | str:
    """(nodes reached, rows reached) from `column`'s output; where it reaches what cannot be sharded, why."""
    reached: set[fx.Node] = set()
    rows: set[fx.Node] = set()
    todo = list(column.users)
    while todo:
        node = todo.pop()
        if node in reached:
            continue
        reached.add(node)
        if is_param_linear(node) and (node.args[0] is column or node.args[0] in reached):
            rows.add(node)
            continue
        if node.op == "output":
            return "reaches the graph's output"
        if not can_carry(node):
            return f"reaches {node.name} ({node.target}), which needs the whole sharded dim or has no shard rule"
        todo.extend(node.users)
    return reached, rows


def _interleave(column: fx.Node) -> int:
    """k of a fused projection: the number of equal pieces of the split of the last dim that reads it."""
    users = list(column.users)
    if len(users) == 1 and op_name(users[0]) in ("split", "chunk"):
        user = users[0]
        dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
        pieces = user.meta.get("val")
        if dim in (-1, len(shape(column)) - 1) and isinstance(pieces, (list, tuple)):
            if len({int(p.shape[-1]) for p in pieces}) == 1:
                return len(pieces)
    return 1


def _groups(columns: list[fx.Node], floods: dict[fx.Node, set[fx.Node]]) -> list[list[fx.Node]]:
    """Columns whose floods share a node, joined (in graph order)."""
    owner: dict[fx.Node, int] = {}
    parent = list(range(len(columns)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, column in enumerate(columns):
        for node in floods[column]:
            if node in owner:
                parent[root(i)] = root(owner[node])
            else:
                owner[node] = i
    grouped: dict[int, list[fx.Node]] = {}
    for i, column in enumerate(columns):
        grouped.setdefault(root(i), []).append(column)
    return list(grouped.values())


def _rows_per_sample(gm: fx.GraphModule) -> int:
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    value = first.meta.get("val") if first is not None else None
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else 1


def _needs_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """Values that depend on a trainable parameter."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if isinstance(value, nn.Parameter) and value.requires_grad:
                found.add(node)
        elif any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _region(gm: fx.GraphModule, columns: list[fx.Node], nodes: set[fx.Node], rows: set[fx.Node],
            grad: set[fx.Node], batch_rows: int) -> TPRegion:
    """Propagate shards through one candidate region; raises Unshardable where it cannot be sharded."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    states: dict[fx.Node, State] = {}
    sizes: list[int] = []
    rewrites: list[SizeRewrite] = []
    specs: list[ShardSpec] = []
    for column in columns:
        k = _interleave(column)
        states[column] = Shard(len(shape(column)) - 1, k)
        for arg in column.args[1:3]:
            if isinstance(arg, fx.Node):
                specs.append(ShardSpec(str(arg.target), 0, k, shape(arg)))
    for node in sorted(nodes - rows, key=order.__getitem__):
        step = propagate(node, states)
        states[node] = step.state
        sizes += step.sizes
        rewrites += step.rewrites
    for row in rows:
        x, weight = arg_node(row, 0), arg_node(row, 1)
        if states.get(x) != Shard(len(shape(x)) - 1):
            raise Unshardable(f"{row.name}: its input is not sharded on its last dim")
        specs.append(ShardSpec(str(weight.target), 1, 1, shape(weight)))
    sizes += [spec.shard_size for spec in specs]
    members = nodes | set(columns)
    param_nodes = {a for n in members for a in n.args[1:3] if isinstance(a, fx.Node) and is_param_linear(n)}
    sharded_targets = {spec.name for spec in specs}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in sharded_targets:
            if any(u not in members for u in node.users) or node not in param_nodes:
                raise Unshardable(f"{node.target}: also read outside the region (a tied weight)")
    inputs = sorted({a for n in members for a in n.all_input_nodes if a not in members and a not in param_nodes},
                    key=order.__getitem__)
    floating = [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point()]
    fwd = sum(math.prod(shape(r)) for r in rows) // batch_rows
    bwd = sum(math.prod(shape(a)) for a in floating if a in grad) // batch_rows
    ordered = sorted(members, key=order.__getitem__)
    dims = [None if n in rows else _dim(states[n]) for n in ordered]
    return TPRegion(tuple(n.name for n in ordered), tuple(dims),
                    tuple(c.name for c in columns), tuple(r.name for r in sorted(rows, key=order.__getitem__)),
                    tuple(specs), tuple(rewrites), tuple(sizes), tuple(a.name for a in floating), fwd, bwd)


def _dim(state: State) -> int:
    return state[0].dim if isinstance(state, tuple) else state.dim


def find_regions(gm: fx.GraphModule) -> TPLayout:
    """Every tensor-parallel region of `gm` (a traced graph with node.meta["val"]), in graph order."""
    floods: dict[fx.Node, set[fx.Node]] = {}
    rows_of: dict[fx.Node, set[fx.Node]] = {}
    failed: list[Rejection] = []
    for node in gm.graph.nodes:
        if is_param_linear(node):
            found = _flood(node)
            if isinstance(found, str):
                failed.append(Rejection((node.name,), found))
            else:
                floods[node], rows_of[node] = found
    grad, batch_rows = _needs_grad(gm), _rows_per_sample(gm)
    regions: list[TPRegion] = []
    taken: set[str] = set()
    for columns in _groups(list(floods), floods):
        nodes = set().union(*(floods[c] for c in columns))
        if any(n.name in taken for n in nodes | set(columns)):
            continue                                        # a row or column of an earlier region
        rows = set().union(*(rows_of[c] for c in columns))
        try:
            region = _region(gm, columns, nodes, rows, grad, batch_rows)
        except Unshardable as exc:
            failed.append(Rejection(tuple(c.name for c in columns), str(exc)))
            continue
        regions.append(region)
        taken.update(region.nodes)
    row_names = {name for region in regions for name in region.rows}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    rejected = sorted((r for r in failed if not row_names.issuperset(r.columns)), key=lambda r: order[r.columns[0]])
    return TPLayout(tuple(regions), tuple(rejected))
