"""Counting per operator: forward and backward FLOPs and bytes, measured by running the op on meta
tensors under `torch.utils.flop_counter.FlopCounterMode` (so backward comes from autograd's own
graph, not from a fixed multiple), cached per (op, shapes, dtypes, constant args) signature."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from planner.core.blocks import OpCount

VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "transpose", "permute", "expand",
    "slice", "select", "t", "alias", "detach", "contiguous", "unflatten", "flatten", "split",
    "chunk", "unbind", "as_strided", "narrow", "getitem", "clone", "lift_fresh_copy",
}
MATMUL_OPS = {"linear", "mm", "bmm", "addmm", "matmul", "baddbmm", "einsum"}
CONV_OPS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution"}
ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math"}


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


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a node's value or arguments (nested tuples, lists, dict values), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def tensor_bytes(value: Any) -> float:
    total = 0.0
    for t in _tensors(value):
        total += t.numel() * t.element_size()
    return total


def _key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_key(v) for v in value)
    if isinstance(value, list):
        return ("list", *(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _key(v)) for k, v in value.items()))
    return repr(value)


def _signature(target: Any, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """What the FLOPs of a call depend on: the op, tensor shapes, dtypes and the constant arguments."""
    return (str(target), _key(args), _key(kwargs))


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
