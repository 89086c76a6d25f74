"""Costing ONNX operations with torch's own counter: the FX call target of an ONNX operation.

An `OnnxOp` stands for the ONNX nodes of one FX node (planner/frontend/onnx_model.py). Its `__name__` is
the torch op's name, which gives costmodel.ops the op class; calling it runs the nodes' dense ops
(matmuls, convolutions, attention) on meta tensors of their ONNX shapes, so that costmodel.ops measures
their forward and backward FLOPs under torch's FlopCounterMode exactly as it measures the torch ops of a
traced model file. Every other ONNX op counts bytes only, as torch's elementwise ops do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from planner.core.errors import ModelFileError

# TensorProto.DataType -> torch dtype name (strings and 4-bit types have none)
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
               10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128",
               16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2", 20: "float8_e5m2fnuz"}
# the ONNX ops with FLOPs, named as the torch op costmodel.ops files in the same class
DENSE = {"MatMul": "matmul", "Gemm": "addmm", "Conv": "convolution", "ConvTranspose": "convolution",
         "Einsum": "einsum", "Attention": "scaled_dot_product_attention"}


class OnnxOp:
    """The call target of one FX node standing for ONNX nodes (see the module docstring); the graph is
    never run, only costed: the arguments are the node's inputs, as costmodel.ops counts their bytes."""

    def __init__(self, name: str, probes: tuple[tuple[str, Callable[[], Any]], ...]) -> None:
        self.__name__ = name
        self.probes = probes

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return tuple(run() for _, run in self.probes)

    def __repr__(self) -> str:   # costmodel.ops caches counts by it: the dense ops and shapes it runs
        return f"onnx.{self.__name__}({'; '.join(text for text, _ in self.probes)})"


def dense(op: str, shapes: list[tuple[int, ...]], out: tuple[int, ...], attrs: dict[str, Any]) -> Callable[[], Any]:
    """What runs ONNX op `op` (one of DENSE) in torch on meta tensors of its input `shapes`, giving `out`;
    every input requires its gradient, as costmodel.ops makes a torch op's."""

    def meta(shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        return torch.empty(tuple(shape), device="meta", requires_grad=True)

    def run() -> Any:
        if op == "MatMul":
            return torch.matmul(meta(shapes[0]), meta(shapes[1]))
        if op == "Gemm":
            a, b = meta(shapes[0]), meta(shapes[1])
            a, b = (a.t() if attrs.get("transA") else a), (b.t() if attrs.get("transB") else b)
            return torch.addmm(meta(shapes[2]), a, b) if len(shapes) > 2 else torch.mm(a, b)
        if op in ("Conv", "ConvTranspose"):
            return _convolution(op == "ConvTranspose", shapes, out, attrs, meta)
        if op == "Einsum":
            return torch.einsum(str(attrs.get("equation", "")), *(meta(s) for s in shapes))
        q, k, v = (meta(s) for s in shapes[:3])   # Attention (opset 23): [B, H, S, D], or [B, S, H*D] with heads
        if q.dim() == 3:
            heads_q, heads_kv = int(attrs.get("q_num_heads", 1)), int(attrs.get("kv_num_heads", 1))
            q = q.unflatten(-1, (heads_q, -1)).transpose(1, 2)
            k, v = (t.unflatten(-1, (heads_kv, -1)).transpose(1, 2) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])

    return run


def _convolution(transposed: bool, shapes: list[tuple[int, ...]], out: tuple[int, ...], attrs: dict[str, Any],
                 meta: Callable[[Any], torch.Tensor]) -> Any:
    """A convolution of the ONNX node's FLOPs: the input padded to give its output shape (any `pads` or
    `auto_pad`), so torch's counter, which reads the shapes, counts what ONNX computes."""
    x, w = list(shapes[0]), shapes[1]
    dims = len(x) - 2
    strides = list(attrs.get("strides") or [1] * dims)
    dilations = list(attrs.get("dilations") or [1] * dims)
    if not transposed:
        for i in range(dims):
            needed = (out[2 + i] - 1) * strides[i] + (w[2 + i] - 1) * dilations[i] + 1
            x[2 + i] = max(x[2 + i], needed)
    bias = meta(shapes[2]) if len(shapes) > 2 else None
    return torch.ops.aten.convolution(meta(x), meta(w), bias, strides, [0] * dims, dilations, transposed,
                                      [0] * dims, int(attrs.get("group", 1)))


def torch_dtype(elem_type: int, file: str, name: str) -> torch.dtype:
    """The torch dtype of ONNX element type `elem_type` (of value `name` in `file`)."""
    dtype = getattr(torch, ONNX_DTYPES.get(elem_type, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ModelFileError(f"value {name} has ONNX element type {elem_type}, which has no torch dtype",
                             file=file, field=name, fix="plan a model of numeric tensors")
    return dtype
