"""Op benchmark points that `plan profile` does not fit on: other shapes of the same op classes as
`planner.profiling.microbench.compute_cases` (odd sizes, more rows, wider layers, other head sizes), timed the same
way (`microbench.measure_case`). Predicting these with a calibration is out of sample; predicting
`compute_cases` would only read back the fit.

Sizes per device kind: on a CPU core from dispatch-bound to a few ms per op, on a GPU up to sizes where
the rates, not launches, decide (the profile's cases are CPU-sized, so on a GPU these extrapolate).
"""

from __future__ import annotations

from typing import Any

import torch

from planner.profiling.microbench import Case, rand

aten = torch.ops.aten


def linear(rows: int, width: int) -> Case:
    def make(dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, tuple[Any, ...]]:
        return rand(rows, width, device=dev, dtype=dt), (rand(width, width, device=dev, dtype=dt),
                                                          rand(width, device=dev, dtype=dt))
    return Case("matmul", f"linear {rows}x{width}", aten.linear.default, make)


def conv3x3(batch: int, channels: int, pixels: int) -> Case:
    def make(dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, tuple[Any, ...]]:
        return (rand(batch, channels, pixels, pixels, device=dev, dtype=dt),
                (rand(channels, channels, 3, 3, device=dev, dtype=dt), None, [1, 1], [1, 1]))
    return Case("conv", f"conv3x3 {batch}x{channels}ch {pixels}px", aten.conv2d.default, make)


def sdpa(batch: int, heads: int, seq: int, head_dim: int) -> Case:
    def make(dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, tuple[Any, ...]]:
        q, k, v = (rand(batch, heads, seq, head_dim, device=dev, dtype=dt) for _ in range(3))
        return q, (k, v)
    return Case("attention", f"sdpa {batch}x{heads}x{seq}x{head_dim} causal",
                aten.scaled_dot_product_attention.default, make, (("is_causal", True),))


def gelu(rows: int, width: int) -> Case:
    return Case("elementwise", f"gelu {rows}x{width}", aten.gelu.default,
                lambda dev, dt: (rand(rows, width, device=dev, dtype=dt), ()))


def add(rows: int, width: int) -> Case:
    return Case("elementwise", f"add {rows}x{width}", aten.add.Tensor,
                lambda dev, dt: (rand(rows, width, device=dev, dtype=dt),
                                 (rand(rows, width, device=dev, dtype=dt),)))


def layer_norm(rows: int, width: int) -> Case:
    return Case("elementwise", f"layer_norm {rows}x{width}", aten.layer_norm.default,
                lambda dev, dt: (rand(rows, width, device=dev, dtype=dt),
                                 ([width], rand(width, device=dev, dtype=dt), rand(width, device=dev, dtype=dt))))


def group_norm(batch: int, channels: int, pixels: int, groups: int) -> Case:
    def make(dev: torch.device, dt: torch.dtype) -> tuple[torch.Tensor, tuple[Any, ...]]:
        return (rand(batch, channels, pixels, pixels, device=dev, dtype=dt),
                (groups, rand(channels, device=dev, dtype=dt), rand(channels, device=dev, dtype=dt)))
    return Case("elementwise", f"group_norm {batch}x{channels}x{pixels}x{pixels}", aten.group_norm.default, make)


def transpose(side: int) -> Case:
    return Case("view", f"transpose {side}x{side}", aten.transpose.int,
                lambda dev, dt: (rand(side, side, device=dev, dtype=dt), (0, 1)))


def held_out_cases(device_kind: str, quick: bool) -> list[Case]:
    """Shapes none of `compute_cases` has; `quick`: one per op class."""
    if device_kind == "cuda":
        cases = [linear(8192, 4096), linear(16, 4096), linear(3000, 1000), conv3x3(16, 128, 56), conv3x3(8, 64, 30),
                 sdpa(8, 16, 1024, 64), sdpa(2, 8, 200, 128), gelu(8192, 2048), add(6000, 1000),
                 layer_norm(16384, 1024), group_norm(32, 64, 28, 8), transpose(1000)]
    else:
        cases = [linear(200, 384), linear(3, 1000), linear(1500, 96), conv3x3(3, 24, 20), conv3x3(2, 48, 12),
                 sdpa(2, 4, 96, 32), sdpa(1, 2, 256, 16), gelu(1000, 96), add(3000, 64), layer_norm(700, 192),
                 group_norm(24, 16, 12, 4), transpose(48)]
    if quick:
        first_of_class: dict[str, Case] = {}
        for case in cases:
            first_of_class.setdefault(case.op_class, case)
        cases = list(first_of_class.values())
    return cases
