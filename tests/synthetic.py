"""Synthetic cost tables for solver tests: the solver sees only numbers."""

from __future__ import annotations

import random

from costmodel.tables import ClassTable, CostTables

GIB = float(1 << 30)


def table(name: str, speed: float, *, blocks: int, devices: int, per_node: int, capacity_gib: float = 40.0,
          block_s: list[float] | None = None, state_gib: list[float] | None = None,
          act_gib: float = 0.0, overhead_s: float = 1e-4, boundary_bytes: float = 1e6,
          intra_gbyte_s: float = 100.0) -> ClassTable:
    block_s = block_s or [1e-3] * blocks
    state = [g * GIB for g in (state_gib or [1.0] * blocks)]
    return ClassTable(
        name=name, device_type=name.upper(), num_devices=devices, per_node=per_node,
        num_nodes=max(1, devices // per_node), precision="fp32", capacity_bytes=capacity_gib * GIB,
        fwd_s=tuple(t / speed / 3 for t in block_s), bwd_s=tuple(2 * t / speed / 3 for t in block_s),
        overhead_s=tuple([overhead_s] * blocks), state_bytes=tuple(state),
        act_bytes=tuple([act_gib * GIB] * blocks), boundary_bytes=tuple([boundary_bytes] * blocks),
        optimizer_s=tuple([1e-5] * blocks), intra_bandwidth_bytes_s=intra_gbyte_s * 1e9,
        intra_latency_s=5e-6)


def tables(classes: list[ClassTable], global_batch: int, *, inter_gbit_s: float = 100.0,
           grad_gib: list[float] | None = None) -> CostTables:
    n = len(classes[0].fwd_s)
    grads = [g * GIB / 4 for g in (grad_gib or [1.0] * n)]
    return CostTables(global_batch=global_batch, num_blocks=n, classes=tuple(classes), grad_bytes=tuple(grads),
                      inter_bandwidth_bytes_s=inter_gbit_s * 1e9 / 8, inter_latency_s=5e-6)


def random_table(rng: random.Random, name: str, blocks: int, devices: int) -> ClassTable:
    return table(name, rng.choice([1.0, 2.0, 3.0]), blocks=blocks, devices=devices, per_node=devices,
                 block_s=[rng.uniform(0.2e-3, 3e-3) for _ in range(blocks)],
                 state_gib=[rng.uniform(0.5, 8.0) for _ in range(blocks)],
                 capacity_gib=rng.choice([16.0, 24.0, 40.0]), boundary_bytes=rng.uniform(1e5, 1e7))
