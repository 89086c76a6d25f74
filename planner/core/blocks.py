"""Block records: what the blocks pass finds in the graph, and what the cost model prices.

An `OpCount` is one operator's device-independent cost (costmodel.ops counts it); a `Block` is a
contiguous run of compute nodes, the unit the search assigns to stages (passes.blocks makes them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpCount:
    """What one node costs, independent of the device."""

    op_class: str            # matmul | conv | attention | elementwise | view | other
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float         # bytes read + written by the forward op
    out_bytes: float         # bytes of the op's output (what a stage boundary would carry)
    # of bwd_flops, the gradient of a trainable weight the op reads (a matmul's or convolution's: its
    # forward's FLOPs again); what a zero-bubble schedule runs apart from the input gradients
    wgrad_flops: float = 0.0



@dataclass(frozen=True)
class Block:
    """A contiguous run of compute nodes; the unit the search assigns to stages."""

    index: int
    first_node: str
    last_node: str
    label: str                       # the module path most of its nodes come from
    ops: tuple[OpCount, ...]
    params: tuple[str, ...]          # trainable parameters (get_attr targets) the block reads
    param_sizes: tuple[float, ...]   # bytes of each of those parameters
    boundary_bytes: float            # activations live after the block (what a cut here sends)
    signature: str                   # equal for structurally identical blocks
    activation_bytes: float          # what autograd keeps of the block for its backward (passes.saved)

    @property
    def param_bytes(self) -> float:
        return sum(self.param_sizes)

    @property
    def largest_output_bytes(self) -> float:
        """The largest output of the block's computing ops (what its backward holds the gradients of)."""
        return max((o.out_bytes for o in self.ops if o.op_class != "view"), default=0.0)

    @property
    def fwd_flops(self) -> float:
        return sum(o.fwd_flops for o in self.ops)

    @property
    def bwd_flops(self) -> float:
        return sum(o.bwd_flops for o in self.ops)

    @property
    def wgrad_fraction(self) -> float:
        """Of the block's backward FLOPs, the part that computes its weights' gradients (0 without a
        backward)."""
        bwd = self.bwd_flops
        return min(1.0, sum(o.wgrad_flops for o in self.ops) / bwd) if bwd > 0 else 0.0


@dataclass(frozen=True)
class BlockSharding:
    """What tensor parallelism can do to one block (passes.tensor_parallel finds it in the graph): the
    Megatron column/row pairs inside it, as numbers the cost model prices at a degree t."""

    degrees: tuple[int, ...]              # degrees every pair of the block divides (1 always among them)
    sharded_params: tuple[str, ...]       # parameters split across the shards (the rest are replicated)
    sharded_param_bytes: float            # their fp32 bytes (of the block's param_bytes)
    sharded_flops_fraction: float         # of the block's forward + backward FLOPs, the part that splits
    sharded_activation_fraction: float    # of the block's kept activations, the part that splits
    allreduce_bytes_fwd: float            # fp32 bytes per sample all-reduced in the forward (row outputs)
    allreduce_bytes_bwd: float            # and in the backward (gradients of the pairs' inputs)
    allreduces: int                       # collectives per micro-batch, each way

    @staticmethod
    def none() -> BlockSharding:
        """A block with nothing to shard."""
        return BlockSharding((1,), (), 0.0, 0.0, 0.0, 0.0, 0.0, 0)

    def divides(self, degree: int) -> bool:
        return degree in self.degrees
