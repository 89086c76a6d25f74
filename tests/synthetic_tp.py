"""Synthetic tensor-parallel numbers (planner.core.blocks.BlockSharding) for solver tests beside
tests/synthetic's tables: the solver sees only numbers."""

from __future__ import annotations

import dataclasses
import random

from costmodel.tables import CostTables
from planner.core.blocks import BlockSharding

DEGREE_SETS = ((1, 2), (1, 2, 4), (1, 2, 4, 8))


def sharding(param_bytes: float, *, degrees: tuple[int, ...] = (1, 2, 4, 8), param_fraction: float = 0.9,
             flops_fraction: float = 0.9, activation_fraction: float = 0.6,
             allreduce_bytes: float = 1e6, allreduces: int = 2) -> BlockSharding:
    """A block whose pairs hold `param_fraction` of its `param_bytes` (fp32) and split at `degrees`."""
    return BlockSharding(degrees=degrees, sharded_params=("w",), sharded_param_bytes=param_fraction * param_bytes,
                         sharded_flops_fraction=flops_fraction, sharded_activation_fraction=activation_fraction,
                         allreduce_bytes_fwd=allreduce_bytes, allreduce_bytes_bwd=allreduce_bytes,
                         allreduces=allreduces)


def with_shardings(tables: CostTables, shardings: list[BlockSharding]) -> CostTables:
    return dataclasses.replace(tables, shardings=tuple(shardings))


def random_shardings(rng: random.Random, tables: CostTables) -> list[BlockSharding]:
    """Per block: pairs or none (one in five), the model's degrees one set for all, random fractions and
    all-reduce bytes from 10 kB to 10 MB per sample."""
    degrees = rng.choice(DEGREE_SETS)
    out = []
    for b in range(tables.num_blocks):
        if rng.random() < 0.2:
            out.append(BlockSharding.none())
            continue
        out.append(sharding(tables.grad_bytes[b], degrees=degrees, param_fraction=rng.uniform(0.5, 1.0),
                            flops_fraction=rng.uniform(0.5, 0.98), activation_fraction=rng.uniform(0.2, 0.9),
                            allreduce_bytes=10 ** rng.uniform(4, 7), allreduces=rng.choice([1, 2, 4])))
    return out
