"""Activation compression on pipeline links: what a stage sends for a value, and how the receiver
turns it back into the value the stage graph expects.

Both ends know a value's traced shape and dtype (from the stage split) and the edge's codec (its
compressor and settings, from the plan's P2PEdge), so each derives the same wire format without a
handshake:

  none       the traced dtype (a value computed in another dtype under autocast is cast back:
             the program's stage boundaries carry the traced dtypes)
  fp16/bf16  a cast to the half type, for floating values wider than 2 bytes
  int8       block-wise int8 (backends.kernels.quant, blocks of the edge's `block_elems`): one
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
from planner.core.errors import PlanFileError
from planner.core.ir import P2PEdge

COMPRESSORS = ("none", "fp16", "bf16", "int8")
SCALE_BYTES = 4                       # one float32 scale per int8 block
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Codec:
    """How one pipeline edge encodes its values: the plan's compressor and its settings."""

    compressor: str = "none"
    block_elems: int = 0                  # int8: elements per block (one float32 scale each)

    def __post_init__(self) -> None:
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"unknown activation compressor {self.compressor!r}; known: {COMPRESSORS}")
        if self.compressor == "int8" and self.block_elems < 1:
            raise PlanFileError("an int8 edge without its block size", field="p2p.block_elems",
                                fix="re-plan with this hetplan version")

    @staticmethod
    def of(edge: P2PEdge) -> Codec:
        return Codec(edge.compressor, edge.block_elems)


NO_CODEC = Codec()


@dataclass(frozen=True)
class WireFormat:
    """The tensor that travels for one value: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def wire_format(codec: Codec, shape: tuple[int, ...], dtype: torch.dtype) -> WireFormat:
    """What travels for a value of traced `shape` and `dtype` under `codec`."""
    if not dtype.is_floating_point or codec.compressor == "none":
        return WireFormat(tuple(shape), dtype)
    if codec.compressor in HALF_DTYPES:
        half = HALF_DTYPES[codec.compressor]
        return WireFormat(tuple(shape), half if dtype.itemsize > half.itemsize else dtype)
    n = math.prod(shape)
    return WireFormat((num_blocks(n, codec.block_elems) * SCALE_BYTES + n,), torch.uint8)


def encode(codec: Codec, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The contiguous wire tensor for `value` (traced dtype `dtype`); `none` keeps `value` bit for bit."""
    fmt = wire_format(codec, tuple(value.shape), dtype)
    if fmt.dtype != torch.uint8 or dtype == torch.uint8:
        return value.detach().to(fmt.dtype).contiguous()
    q, scales = quantize_int8(value.detach(), codec.block_elems)
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)])


def decode(codec: Codec, wire: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The value (traced `shape`, `dtype`) from its wire tensor."""
    fmt = wire_format(codec, shape, dtype)
    if fmt.dtype != torch.uint8 or dtype == torch.uint8:
        return wire.to(dtype)
    n = math.prod(shape)
    split = num_blocks(n, codec.block_elems) * SCALE_BYTES
    scales = wire[:split].view(torch.float32)
    q = wire[split:].view(torch.int8)
    return dequantize_int8(q, scales, codec.block_elems, n).view(shape).to(dtype)
