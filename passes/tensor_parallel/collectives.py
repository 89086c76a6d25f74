"""Megatron's f and g operators as autograd functions the rewritten FX graph calls.

`copy_to_tp_region` (f): identity forward; backward, the all-reduce of the gradient over the TP group,
since each rank's region computes only its shard's part of the input's gradient. `reduce_from_tp_region`
(g): the all-reduce of the row-parallel linears' partial outputs forward; identity backward, since every
rank needs the whole output's gradient and already holds it. Both are module-level functions, so the
graph's generated code calls them by name and a stage module cut from it (passes.split) does too; the
group is the graph's attribute `TP_GROUP_ATTR` (a `TPGroup`, never None: FX checks that a get_attr's
attribute exists), read by a get_attr node. On meta tensors (a dry run, a
planning trace) no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TP_GROUP_ATTR = "tp_group"     # the GraphModule attribute holding the TP ranks' group


@dataclass(frozen=True)
class TPGroup:
    """The TP ranks' ProcessGroup (None: the default group) as a graph attribute."""

    group: Any = None


def _all_reduce(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    summed = tensor.contiguous().clone()
    if not summed.is_meta:
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group.group)
    return summed


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp_region(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (what enters a TP region)."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """All-reduce forward (the row linears' partial sums), identity backward."""
    return _ReduceFromRegion.apply(x, group)
