"""This rank's tensor-parallel shard: its stage's column/row pairs cut to 1/t, and its slice of their weights.

A stage of a plan with tensor parallelism runs on t ranks of one node (StagePlan.tp_ranks), each a lane of
its replica: lane j's ranks form a pipeline of their own on the replica's rows, and each stage's lanes
share one process group (process_group.Context.tp_group). Every traced graph is rewritten before it is
split (passes.tensor_parallel: the Megatron pairs found in the graph, one all-reduce forward per pair and
one backward), and each parameter a pair splits is replaced by this lane's slice after the init contract
(or --weights) gave it its full value, so the shards together hold exactly the single-process values.
Replicated parameters (norms, embeddings) get identical gradients on every lane (the pairs' collectives
leave every lane the same values), so each lane syncs its own copy across replicas only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from passes.tensor_parallel import ShardSpec, TPLayout, find_regions
from passes.tensor_parallel.rewrite import local_parameters, shard_graph

from .process_group import Context


@dataclass
class Shards:
    """Lane `lane` of degree `degree`, its collectives on `group`."""

    degree: int
    lane: int
    group: object
    layout: TPLayout | None = field(default=None)

    @staticmethod
    def of(ctx: Context) -> Shards | None:
        """This rank's shards, or None where its stage runs whole."""
        if ctx.stage.tp_degree == 1:
            return None
        return Shards(ctx.stage.tp_degree, ctx.lane, ctx.tp_group)

    def shard_graph(self, gm: fx.GraphModule) -> None:
        """Rewrite one traced graph of the model to this lane's shard (every micro-batch size's, in turn)."""
        layout = find_regions(gm)
        if self.layout is None:
            self.layout = layout
        shard_graph(gm, layout, self.degree, self.lane, self.group)

    def shard_values(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`values` (name -> full tensor) with each split parameter replaced by this lane's slice."""
        if self.layout is None:
            raise RuntimeError("Shards.shard_values before any graph was sharded")
        return local_parameters(values, self.layout, self.degree, self.lane)

    def specs(self) -> dict[str, ShardSpec]:
        """How each split parameter is cut (for putting final weights back together)."""
        return self.layout.specs() if self.layout is not None else {}
