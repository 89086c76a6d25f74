"""Tensor parallelism as an FX graph rewrite: find Megatron-style regions in a traced graph
(regions.py, by the shard rules of rules.py), cost them for the planner (costs.py), and rewrite a graph
to run one shard of degree t with autograd-aware collectives (rewrite.py, collectives.py)."""

from .collectives import TPGroup, copy_to_tp_region, reduce_from_tp_region
from .costs import TPBlockCost, block_cost
from .layout import Rejection, ShardSpec, SizeRewrite, TPLayout, TPRegion, shard_tensor, unshard
from .regions import find_regions
from .rewrite import local_parameters, shard_graph

__all__ = ["Rejection", "ShardSpec", "SizeRewrite", "TPBlockCost", "TPGroup", "TPLayout", "TPRegion", "block_cost",
           "copy_to_tp_region", "find_regions", "local_parameters", "reduce_from_tp_region", "shard_graph",
           "shard_tensor", "unshard"]
