"""Gradient compressors for explicit bucketed all-reduce or as DDP communication hooks.

`make_compressor(name, group, settings)` for `none`, `fp16`, `bf16`, `powersgd`, `onebit` (`settings`:
the plan's GradGroup.settings, what the group's compressor runs with); then
`compressor.allreduce_mean_(FlatBucket(flat, shapes, index=i))` averages a bucket in
place over the group and sets `compressor.last_wire_bytes`. The built-in torch hooks are
reused through `FlatBucket` / `run_comm_hook`; `onebit` is ours (backends.kernels).
`OneBitAdamW` is 1-bit Adam: under AdamW a 1-bit group exchanges compressed momentum, not gradients.
"""

from backends.compression.base import GradientCompressor
from backends.compression.bucket import CommHook, FlatBucket, run_comm_hook
from backends.compression.hooks import (
    Bf16Compressor,
    Fp16Compressor,
    NoCompression,
    PowerSGDCompressor,
    bf16_round_fp32_wire_hook,
)
from backends.compression.onebit import (
    OneBitCompressor,
    OneBitState,
    compress_with_feedback,
    onebit_allreduce_mean_,
    onebit_hook,
    onebit_wire_bytes,
    onebit_wire_ratio,
)
from backends.compression.onebit_adam import MomentumExchange, OneBitAdamW, freeze_step
from backends.compression.registry import COMPRESSORS, CompressorFactory, make_compressor, settings_options
from backends.compression.wire import CollectiveTap, WireRecord, payload_nbytes

__all__ = [
    "COMPRESSORS",
    "Bf16Compressor",
    "CollectiveTap",
    "CommHook",
    "CompressorFactory",
    "FlatBucket",
    "Fp16Compressor",
    "GradientCompressor",
    "MomentumExchange",
    "NoCompression",
    "OneBitAdamW",
    "OneBitCompressor",
    "OneBitState",
    "PowerSGDCompressor",
    "WireRecord",
    "bf16_round_fp32_wire_hook",
    "compress_with_feedback",
    "freeze_step",
    "make_compressor",
    "onebit_allreduce_mean_",
    "onebit_hook",
    "onebit_wire_bytes",
    "onebit_wire_ratio",
    "payload_nbytes",
    "run_comm_hook",
    "settings_options",
]
