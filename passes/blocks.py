"""Blocks: coarsen the node sequence into partitionable blocks.

A cut after node i is a candidate where the fewest activations are live (a residual stream, not
the inside of an attention or a residual branch). Skip connections are simply live values that
cross cuts: they count in the boundary bytes and travel to their consumer's stage. When there are
more candidates than `max_blocks`, the cuts at the shallowest module boundaries are kept
(between transformer layers rather than inside one). Identical blocks share a signature, so
repeated layers can be tied by the search.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import torch.fx as fx

from passes.annotate import COST_KEY, PARAM_BYTES_KEY
from passes.base import Pass, PassResult
from passes.saved import KEPT_KEY, trainable_dependent
from planner.core.blocks import Block
from planner.core.errors import PassError

BLOCKS_KEY = "hetplan.blocks"
BLOCK_INDEX_KEY = "hetplan.block"
DEFAULT_MAX_BLOCKS = 96


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _module_path(node: fx.Node) -> tuple[str, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(str(v[0]) for v in stack.values())


def _common_depth(a: fx.Node, b: fx.Node) -> int:
    pa, pb = _module_path(a), _module_path(b)
    depth = 0
    for x, y in zip(pa, pb):
        if x != y:
            break
        depth += 1
    return depth


def live_after(nodes: list[fx.Node], count_only: set[fx.Node] | None = None) -> tuple[list[int], list[float]]:
    """For each position i: how many activations (and all live bytes) are live after node i.

    `count_only` restricts the count (not the bytes) to those nodes.
    """
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    delta_count = [0] * (end + 1)
    delta_bytes = [0.0] * (end + 1)
    for n in nodes:
        last = max((position.get(u, end) for u in n.users), default=position[n])
        if last > position[n]:
            nbytes = n.meta[COST_KEY].out_bytes if n.meta[COST_KEY].op_class != "view" else 0.0
            nbytes = nbytes or _val_bytes(n)
            if count_only is None or n in count_only:
                delta_count[position[n]] += 1
                delta_count[last] -= 1
            delta_bytes[position[n]] += nbytes
            delta_bytes[last] -= nbytes
    counts, sizes, c, s = [], [], 0, 0.0
    for i in range(end):
        c += delta_count[i]
        s += delta_bytes[i]
        counts.append(c)
        sizes.append(s)
    return counts, sizes


def _val_bytes(n: fx.Node) -> float:
    from costmodel.ops import tensor_bytes

    return tensor_bytes(n.meta.get("val"))


def _reads_parameter(node: fx.Node) -> bool:
    return any(a.op == "get_attr" and getattr(a.meta.get("val"), "requires_grad", False)
               for a in node.all_input_nodes)


def choose_cuts(nodes: list[fx.Node], counts: list[int], max_blocks: int) -> list[int]:
    """Positions after which to cut: fewest live activations, no parameter-free blocks, then the
    shallowest module boundaries (whole levels only, so repeated layers get identical blocks)."""
    interior = range(len(nodes) - 1)
    if not interior:
        return []
    floor = min(counts[i] for i in interior)
    cuts: list[int] = []
    for slack in range(3):
        cuts = [i for i in interior if counts[i] <= floor + slack]
        if len(cuts) >= min(8, len(nodes) - 1):
            break
    # a block that reads no parameter costs next to nothing: merge it into the next one
    merged, since = [], 0
    for i in cuts:
        if any(_reads_parameter(n) for n in nodes[since:i + 1]):
            merged.append(i)
            since = i + 1
    cuts = merged
    if len(cuts) < max_blocks:
        return cuts
    by_depth: dict[int, list[int]] = {}
    for i in cuts:
        by_depth.setdefault(_common_depth(nodes[i], nodes[i + 1]), []).append(i)
    kept: list[int] = []
    for depth in sorted(by_depth):
        room = max_blocks - 1 - len(kept)
        level = by_depth[depth]
        if len(level) <= room:
            kept.extend(level)
            continue
        if not kept:  # not even the shallowest level fits: take an even subset of it
            step = len(level) / room
            kept.extend(level[int(k * step)] for k in range(room))
        break
    return sorted(kept)


class Blocks(Pass):
    """Coarsen compute nodes into blocks; writes gm.meta[BLOCKS_KEY] and node.meta[BLOCK_INDEX_KEY]."""

    name = "blocks"

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks

    def requires(self, gm: fx.GraphModule) -> None:
        if any(COST_KEY not in n.meta for n in compute_nodes(gm.graph)):
            raise PassError("blocks needs the annotate pass first", fix="run Annotate before Blocks")
        if any(KEPT_KEY not in n.meta for n in compute_nodes(gm.graph)):
            raise PassError("blocks needs the saved pass first", fix="run SavedActivations before Blocks")

    def call(self, gm: fx.GraphModule) -> PassResult:
        nodes = compute_nodes(gm.graph)
        if not nodes:
            raise PassError("the traced model has no operations", fix="check that forward() computes something")
        counts, sizes = live_after(nodes, trainable_dependent(gm.graph))
        cuts = choose_cuts(nodes, counts, self.max_blocks)
        bounds = [-1, *cuts, len(nodes) - 1]
        blocks: list[Block] = []
        for b in range(len(bounds) - 1):
            members = nodes[bounds[b] + 1: bounds[b + 1] + 1]
            for n in members:
                n.meta[BLOCK_INDEX_KEY] = b
            # trainable parameters only: buffers and constants are not trained or synchronised
            attr_nodes = {str(a.target): a for n in members for a in n.all_input_nodes
                          if a.op == "get_attr" and getattr(a.meta.get("val"), "requires_grad", False)}
            params = sorted(attr_nodes)
            param_sizes = tuple(attr_nodes[p].meta[PARAM_BYTES_KEY] for p in params)
            paths = [_module_path(n)[-1] if _module_path(n) else "" for n in members]
            # the most frequent path; on a tie the earliest, so the label is the same in every process
            label = Counter(paths).most_common(1)[0][0]
            last = bounds[b + 1]
            blocks.append(Block(
                index=b, first_node=members[0].name, last_node=members[-1].name, label=label,
                ops=tuple(n.meta[COST_KEY] for n in members), params=tuple(params),
                param_sizes=param_sizes, boundary_bytes=sizes[last] if last < len(nodes) - 1 else 0.0,
                signature=_signature(members), activation_bytes=sum(n.meta[KEPT_KEY].bytes for n in members)))
        gm.meta[BLOCKS_KEY] = blocks
        return PassResult(gm, True)


def _signature(members: list[fx.Node]) -> str:
    h = hashlib.sha1()
    for n in members:
        val = n.meta.get("val")
        shape = tuple(getattr(val, "shape", ()))
        h.update(f"{n.target}|{shape}|{getattr(val, 'dtype', '')};".encode())
    return h.hexdigest()[:16]
