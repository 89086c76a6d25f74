"""Triton kernels for compressed collectives, each with a pure-torch reference.

`onebit`: error feedback, sign packing and unpack + average of 1-bit Adam's compressed
all-reduce. `quant`: block-wise int8 quantise / dequantise for activations on slow links.
Every entry point takes `impl="auto" | "triton" | "torch"`; `auto` launches the Triton
kernel for CUDA tensors, or on CPU when `TRITON_INTERPRET=1` was set before triton was
imported, and otherwise runs the reference. Triton is optional: without it the package
imports and runs the references.
"""

from backends.kernels._triton import HAS_TRITON, INTERPRETED, Impl, use_triton
from backends.kernels.onebit import (
    add_error_and_sqnorm,
    add_error_and_sqnorm_ref,
    packed_nbytes,
    sign_pack,
    sign_pack_ref,
    unpack_average,
    unpack_average_ref,
    unpack_signs_ref,
)
from backends.kernels.quant import (
    dequantize_int8,
    dequantize_int8_ref,
    num_blocks,
    quantize_int8,
    quantize_int8_ref,
)

__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "Impl",
    "add_error_and_sqnorm",
    "add_error_and_sqnorm_ref",
    "dequantize_int8",
    "dequantize_int8_ref",
    "num_blocks",
    "packed_nbytes",
    "quantize_int8",
    "quantize_int8_ref",
    "sign_pack",
    "sign_pack_ref",
    "unpack_average",
    "unpack_average_ref",
    "unpack_signs_ref",
    "use_triton",
]
