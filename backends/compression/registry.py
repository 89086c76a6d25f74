"""Compressors by name: the names a plan's gradient groups use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from backends.compression.base import GradientCompressor
from backends.compression.hooks import Bf16Compressor, Fp16Compressor, NoCompression, PowerSGDCompressor
from backends.compression.onebit import OneBitCompressor

CompressorFactory = Callable[..., GradientCompressor]
"""Called as factory(process_group, **options) -> a fresh compressor (its own state)."""

COMPRESSORS: Mapping[str, CompressorFactory] = MappingProxyType({
    cls.name: cls
    for cls in (NoCompression, Fp16Compressor, Bf16Compressor, PowerSGDCompressor, OneBitCompressor)
})
"""`none`, `fp16`, `bf16`, `powersgd`, `onebit` -> compressor class."""


def make_compressor(name: str, process_group: dist.ProcessGroup | None = None,
                    **options: Any) -> GradientCompressor:
    """A new compressor `name` over `process_group` (None: the default group).

    `options` go to the class: `powersgd` takes rank, start_iter, min_compression_rate,
    use_error_feedback, warm_start, seed, batched; `onebit` takes server_error_feedback,
    impl; `bf16` takes wire.
    """
    factory = COMPRESSORS.get(name)
    if factory is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(sorted(COMPRESSORS))}")
    return factory(process_group, **options)
