"""The blocks' tensor-parallel numbers (planner.core.blocks.BlockSharding) from the traced graph.

passes.tensor_parallel finds the Megatron pairs of the whole graph; here each block (a contiguous run of
compute nodes, passes.blocks) gets what the cost model prices at a degree: the bytes of its parameters the
pairs split, the part of its matmul FLOPs and of its kept activations inside pairs, and the all-reduces of
the pairs whose row linears it holds. A degree is offered for the model when it divides every pair (the
program shards every pair of the graph at the plan's degree); blocks without pairs run whole. A graph
whose pairs span block boundaries gets none (a cut inside a pair would send a shard).
"""

from __future__ import annotations

import torch.fx as fx

from passes.saved import KEPT_KEY
from passes.tensor_parallel import TPLayout, find_regions
from passes.tensor_parallel.costs import block_cost
from planner.core.blocks import Block, BlockSharding

DEGREES = (1, 2, 4, 8)


def block_shardings(gm: fx.GraphModule, blocks: list[Block],
                    layout: TPLayout | None = None) -> tuple[BlockSharding, ...]:
    """Per block, what tensor parallelism splits (all BlockSharding.none() when the graph has no pairs)."""
    layout = layout if layout is not None else find_regions(gm)
    if not layout.regions or _crosses_a_cut(gm, layout, blocks):
        return tuple(BlockSharding.none() for _ in blocks)
    degrees = tuple(t for t in DEGREES if layout.divides(t))
    specs = layout.specs()
    order = [n.name for n in gm.graph.nodes]
    position = {name: i for i, name in enumerate(order)}
    in_region = {name for region in layout.regions for name in region.nodes}
    by_name = {n.name: n for n in gm.graph.nodes}
    out = []
    for b in blocks:
        names = order[position[b.first_node]:position[b.last_node] + 1]
        cost = block_cost(gm, layout, names)
        regions = [r for r in layout.regions if any(row in set(names) for row in r.rows)]
        # what the block keeps for its backward (passes.saved): a kept value splits where a pair made it, an
        # op's own kept tensors (attention's log-sum-exp) where the op is inside a pair
        act_all = act_in = 0.0
        for name in names:
            kept = by_name[name].meta.get(KEPT_KEY)
            if kept is None:
                continue
            act_all += kept.bytes
            act_in += (kept.internal_bytes if name in in_region else 0.0) + \
                sum(nbytes for maker, nbytes in kept.values if maker in in_region)
        out.append(BlockSharding(
            degrees=degrees, sharded_params=tuple(p for p in b.params if p in specs),
            sharded_param_bytes=float(cost.sharded_param_bytes),
            sharded_flops_fraction=cost.sharded_flop_fraction,
            sharded_activation_fraction=act_in / act_all if act_all else 0.0,
            allreduce_bytes_fwd=float(cost.fwd_allreduce_bytes_per_sample),
            allreduce_bytes_bwd=float(cost.bwd_allreduce_bytes_per_sample),
            allreduces=sum(len(r.rows) for r in regions)))
    return tuple(out)


def _crosses_a_cut(gm: fx.GraphModule, layout: TPLayout, blocks: list[Block]) -> bool:
    """Whether some pair spans two blocks: a stage could then end inside it and send a shard (an MLP whose
    blocks end at each linear). The program shards every pair of the graph, so no degree is offered then."""
    order = [n.name for n in gm.graph.nodes]
    position = {name: i for i, name in enumerate(order)}
    ends = sorted(position[b.last_node] for b in blocks)
    for region in layout.regions:
        computed = [position[n] for n in region.nodes if n in position]
        if computed and any(min(computed) <= end < max(computed) for end in ends):
            return True
    return False
