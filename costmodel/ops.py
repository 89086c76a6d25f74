"""Counting per operator: forward and backward FLOPs and bytes, measured by running the op on meta
tensors under `torch.utils.flop_counter.FlopCounterMode` (so backward comes from autograd's own
graph, not from a fixed multiple), cached per (op, shapes, dtypes, constant args) signature."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "transpose", "permute", "expand",
    "slice", "select", "t", "alias", "detach", "contiguous", "unflatten", "flatten", "split",
    "chunk", "unbind", "as_strided", "narrow", "getitem", "clone", "lift_fresh_copy",
}
MATMUL_OPS = {"linear", "mm", "bmm", "addmm", "matmul", "baddbmm", "einsum"}
CONV_OPS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution"}
ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math"}


@dataclass(frozen=True)
class OpCount:
    """What one node costs, independent of the device."""

    op_class: str            # matmul | conv | attention | elementwise | view | other
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float         # bytes read + written by the forward op
    out_bytes: float         # bytes of the op's output (what a stage boundary would carry)


def op_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def op_class(target: Any) -> str:
    name = op_name(target)
    if name in VIEW_OPS:
        return "view"
    if name in MATMUL_OPS:
        return "matmul"
    if name in CONV_OPS:
        return "conv"
    if name in ATTENTION_OPS:
        return "attention"
    if hasattr(target, "_schema") or callable(target):
        return "elementwise"
    return "other"


def tensor_bytes(value: Any) -> float:
    total = 0.0

    def add(v: Any) -> Any:
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        return v

    tree_map(add, value)
    return total


def _signature(target: Any, args: Any, kwargs: Any) -> tuple[Any, ...]:
    def key(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), str(v.dtype), v.requires_grad)
        return repr(v)

    flat_args = tree_map(key, (args, kwargs))
    return (str(target), repr(flat_args))


def _as_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
        if t.is_floating_point():
            t.requires_grad_(True)
        return t
    if isinstance(v, torch.device):
        return torch.device("meta")
    return v


class OpCounter:
    """Counts ops on meta tensors; one measurement per distinct signature."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], tuple[float, float]] = {}
        self.measured = 0

    def count(self, target: Any, args: Any, kwargs: Any, out: Any) -> OpCount:
        cls = op_class(target)
        out_bytes = tensor_bytes(out)
        if cls == "view":
            return OpCount(cls, 0.0, 0.0, 0.0, 0.0)
        in_bytes = tensor_bytes((args, kwargs))
        fwd, bwd = self._flops(target, args, kwargs)
        return OpCount(cls, fwd, bwd, in_bytes + out_bytes, out_bytes)

    def _flops(self, target: Any, args: Any, kwargs: Any) -> tuple[float, float]:
        key = _signature(target, args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._measure(target, args, kwargs)
            self.measured += 1
        return self._cache[key]

    @staticmethod
    def _measure(target: Any, args: Any, kwargs: Any) -> tuple[float, float]:
        meta_args, meta_kwargs = tree_map(_as_meta, (args, kwargs))
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                out = target(*meta_args, **meta_kwargs)
                fwd = float(counter.get_total_flops())
                outs = [o for o in torch.utils._pytree.tree_leaves(out)
                        if isinstance(o, torch.Tensor) and o.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])
                total = float(counter.get_total_flops())
        except Exception:  # ops without meta/autograd support count no FLOPs (bytes still count)
            return 0.0, 0.0
        return fwd, total - fwd
