"""What tensor-parallel analysis found: typed, frozen records, and slicing parameters by their spec.

A `TPLayout` lists the Megatron-style regions of one traced graph (regions.py finds them). A region is
column-parallel linears (weight and bias sharded on dim 0) on a replicated input, the ops after them that
keep the sharded dimension separable, and row-parallel linears (weight sharded on dim 1) whose partial
outputs are summed by one all-reduce forward; the gradient of what enters the region is summed by one
all-reduce backward (Megatron's f and g operators). Nothing here holds torch.fx objects: nodes are named,
so a record can be compared, printed and handed to the planner.

`ShardSpec.interleave` k > 1 is strided sharding of a fused projection: the sharded dimension of size n is
(k, n/k) and each of the k blocks is sliced (GPT's qkv linear followed by split into 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is cut: along `dim`, as `interleave` blocks each sliced into `degree` parts."""

    name: str            # qualified parameter name (a get_attr target), e.g. blocks.0.attn.qkv.weight
    dim: int
    interleave: int
    shape: tuple[int, ...]       # the full parameter's shape

    @property
    def shard_size(self) -> int:
        """Elements of the sharded dim per interleave block: what the degree must divide."""
        return self.shape[self.dim] // self.interleave


@dataclass(frozen=True)
class SizeRewrite:
    """A concrete size in a node's arguments that is a sharded size: divided by the degree in the shard."""

    node: str
    arg: int                     # position in node.args
    item: int | None             # index in a list argument (view/reshape/expand shapes); None: a scalar
    full: int


@dataclass(frozen=True)
class TPRegion:
    """One tensor-parallel region (an attention or an MLP of a transformer layer)."""

    nodes: tuple[str, ...]           # every node sharded inside the region, columns and rows included
    local_dims: tuple[int | None, ...]   # per node: its sharded dim (of each piece of a list); rows: None
    columns: tuple[str, ...]         # column-parallel aten.linear nodes
    rows: tuple[str, ...]            # row-parallel aten.linear nodes
    params: tuple[ShardSpec, ...]
    rewrites: tuple[SizeRewrite, ...]
    sizes: tuple[int, ...]           # every sharded size in the region (per interleave block)
    inputs: tuple[str, ...]          # values entering from outside: copy-to-region (all-reduce of grad)
    fwd_allreduce_elems_per_sample: int     # sum over rows of their output's elements / batch rows
    bwd_allreduce_elems_per_sample: int     # sum over inputs that need grad of their elements / batch rows

    def divides(self, degree: int) -> bool:
        """Whether `degree` shards this region: it divides every sharded size."""
        return degree >= 1 and all(size % degree == 0 for size in self.sizes)

    @property
    def max_degree(self) -> int:
        """The largest degree that shards the region (the gcd of its sharded sizes)."""
        return math.gcd(*self.sizes) if self.sizes else 1


@dataclass(frozen=True)
class Rejection:
    """Candidate column linears left replicated, and why (the first op that cannot carry the shard)."""

    columns: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class TPLayout:
    """Every tensor-parallel region of one traced graph, in graph order; `rejected`: the candidates that
    stay replicated (row linears of a region excepted), for a report's "why not sharded"."""

    regions: tuple[TPRegion, ...]
    rejected: tuple[Rejection, ...] = ()

    def divides(self, degree: int) -> bool:
        return all(region.divides(degree) for region in self.regions)

    def degrees(self, up_to: int) -> tuple[int, ...]:
        """The degrees 1..up_to that shard every region."""
        return tuple(t for t in range(1, up_to + 1) if self.divides(t))

    @property
    def max_degree(self) -> int:
        return math.gcd(*(region.max_degree for region in self.regions)) if self.regions else 1

    def specs(self) -> dict[str, ShardSpec]:
        """Qualified parameter name -> its shard spec, over all regions."""
        return {spec.name: spec for region in self.regions for spec in region.params}

    def region_of(self, node_name: str) -> TPRegion | None:
        for region in self.regions:
            if node_name in region.nodes:
                return region
        return None


def shard_tensor(full: torch.Tensor, spec: ShardSpec, degree: int, index: int) -> torch.Tensor:
    """Rank `index`'s shard of the full parameter `full` (a copy; meta in, meta out)."""
    blocks = full.chunk(spec.interleave, dim=spec.dim)
    return torch.cat([block.chunk(degree, dim=spec.dim)[index] for block in blocks], dim=spec.dim).clone()


def unshard(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full parameter from every rank's shard (in rank order): shard_tensor's inverse."""
    per_rank = [shard.chunk(spec.interleave, dim=spec.dim) for shard in shards]
    blocks = [torch.cat([rank[b] for rank in per_rank], dim=spec.dim) for b in range(spec.interleave)]
    return torch.cat(blocks, dim=spec.dim)
