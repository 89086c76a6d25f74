"""Activation compression on pipeline links: what a stage sends for a value, and how the receiver
turns it back into the value the stage graph expects.

Both ends know a value's traced shape and dtype (from the stage split) and the edge's compressor
(from the plan), so each derives the same wire format without a handshake:

  none       the traced dtype (a value computed in another dtype under autocast is cast back:
             the program's stage boundaries carry the traced dtypes)
  fp16/bf16  a cast to the half type, for floating values wider than 2 bytes
  int8       block-wise int8 (backends.kernels.quant, blocks of costmodel INT8_BLOCK_ELEMS): one
             uint8 message holding the float32 scales, then the int8 codes; scales first, so the
             float32 view of the message starts aligned

Values that are not floating point (token ids, masks) always travel as they are. The same format
carries the value's gradient back in the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backends.kernels import dequantize_int8, num_blocks, quantize_int8
from costmodel.compression import ACTIVATION_COMPRESSORS, INT8_BLOCK_ELEMS, SCALE_BYTES

HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class WireFormat:
    """The tensor that travels for one value: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _check(compressor: str) -> None:
    if compressor not in ACTIVATION_COMPRESSORS:
        raise ValueError(f"unknown activation compressor {compressor!r}; known: {ACTIVATION_COMPRESSORS}")


def wire_format(compressor: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireFormat:
    """What travels for a value of traced `shape` and `dtype` under `compressor`."""
    _check(compressor)
    if not dtype.is_floating_point or compressor == "none":
        return WireFormat(tuple(shape), dtype)
    if compressor in HALF_DTYPES:
        half = HALF_DTYPES[compressor]
        return WireFormat(tuple(shape), half if dtype.itemsize > half.itemsize else dtype)
    n = math.prod(shape)
    return WireFormat((num_blocks(n, INT8_BLOCK_ELEMS) * SCALE_BYTES + n,), torch.uint8)


def encode(compressor: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The contiguous wire tensor for `value` (traced dtype `dtype`); `none` keeps `value` bit for bit."""
    fmt = wire_format(compressor, tuple(value.shape), dtype)
    if fmt.dtype != torch.uint8 or dtype == torch.uint8:
        return value.detach().to(fmt.dtype).contiguous()
    q, scales = quantize_int8(value.detach(), INT8_BLOCK_ELEMS)
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])


def decode(compressor: str, wire: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The value (traced `shape`, `dtype`) from its wire tensor."""
    fmt = wire_format(compressor, shape, dtype)
    if fmt.dtype != torch.uint8 or dtype == torch.uint8:
        return wire.to(dtype)
    n = math.prod(shape)
    split = num_blocks(n, INT8_BLOCK_ELEMS) * SCALE_BYTES
    scales = wire[:split].view(torch.float32)
    q = wire[split:].view(torch.int8)
    return dequantize_int8(q, scales, INT8_BLOCK_ELEMS, n).view(shape).to(dtype)
