"""Compressors by name: the names a plan's gradient groups use, built with the runtime settings the
plan records for them (planner.core.ir.CompressorSettings), never the cost model's defaults."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from backends.compression.base import GradientCompressor
from backends.compression.hooks import Bf16Compressor, Fp16Compressor, NoCompression, PowerSGDCompressor
from backends.compression.onebit import OneBitCompressor
from planner.core.plan_records import CompressorSettings

CompressorFactory = Callable[..., GradientCompressor]
"""Called as factory(process_group, **options) -> a fresh compressor (its own state)."""

COMPRESSORS: Mapping[str, CompressorFactory] = MappingProxyType({
    cls.name: cls
    for cls in (NoCompression, Fp16Compressor, Bf16Compressor, PowerSGDCompressor, OneBitCompressor)
})
"""`none`, `fp16`, `bf16`, `powersgd`, `onebit` -> compressor class."""


def settings_options(name: str, settings: CompressorSettings | None) -> dict[str, Any]:
    """The constructor options of compressor `name` that a plan's settings fix (PowerSGD's rank,
    start iteration and minimum compression rate; the others take none: bucket sizes are the
    caller's, `settings.bucket_ranges`, and 1-bit Adam's warm-up the optimizer's,
    onebit_adam.freeze_step)."""
    if settings is None or name != "powersgd":
        return {}
    if settings.rank < 1:
        raise ValueError(f"powersgd settings need a rank of at least 1, got {settings.rank}")
    return {"rank": settings.rank, "start_iter": settings.start_iter,
            "min_compression_rate": settings.min_compression_rate}


def make_compressor(name: str, process_group: dist.ProcessGroup | None = None,
                    settings: CompressorSettings | None = None, **options: Any) -> GradientCompressor:
    """A new compressor `name` over `process_group` (None: the default group), run with a plan's
    `settings` (GradGroup.settings) where given.

    `options` go to the class: `powersgd` takes rank, start_iter, min_compression_rate,
    use_error_feedback, warm_start, seed, batched (the first three come from `settings` when it is
    given, and may not be passed both ways); `onebit` takes server_error_feedback, impl; `bf16`
    takes wire.
    """
    factory = COMPRESSORS.get(name)
    if factory is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(sorted(COMPRESSORS))}")
    from_plan = settings_options(name, settings)
    both = sorted(from_plan.keys() & options.keys())
    if both:
        raise ValueError(f"{name}: {', '.join(both)} given both in the plan's settings and as options")
    return factory(process_group, **from_plan, **options)
