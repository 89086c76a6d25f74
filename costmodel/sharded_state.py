"""ZeRO-1 priced: the cost tables of stages whose optimizer state is sharded across their replicas.

With the AdamW moments of a stage's parameters split over a gradient group of at least z ranks, each
rank keeps its weights and gradients whole and 1/z of the moments, steps only its part (1/z of the
optimizer's time) and then gathers the others' updated parts: (z-1)/z of the stage's parameters over
the network between nodes (the group spans replicas) after every step, one broadcast per parameter
tensor from its owner (what torch's ZeroRedundancyOptimizer issues; benchmarks/fidelity_collectives.py
counts them). The tables price the group at its smallest size z; the search then keeps at least z replicas
(planner.search.degrees), and a larger group only needs less.
"""

from __future__ import annotations

import dataclasses

from costmodel import memory
from costmodel.tables import ClassTable, CostTables, reader_pairs

ADAMW_MOMENT_FACTOR = 2.0      # of ADAMW_STATE_FACTOR's weights + gradients + two moments


def moment_bytes(state_bytes: float, precision: str) -> float:
    """The AdamW moments' part of a block's training state (costmodel.memory.state_bytes)."""
    return state_bytes * ADAMW_MOMENT_FACTOR / memory.state_bytes(1.0, precision)


def optimizer_part_bytes(state_bytes: float, precision: str, group: int) -> float:
    """The AdamW moments' part of a training state priced at ZeRO group `group` (`at_group`: every rank
    keeps its weights and gradients whole and 1/group of the moments)."""
    moments = ADAMW_MOMENT_FACTOR / max(group, 1)
    return state_bytes * moments / (memory.state_bytes(1.0, precision) - ADAMW_MOMENT_FACTOR + moments)


def allgather_s(nbytes: float, ranks: int, bandwidth_bytes_s: float, latency_s: float) -> float:
    """Ring all-gather of a buffer of `nbytes` whose parts live on `ranks` ranks: (n-1)/n of it moves."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * latency_s + (ranks - 1) / ranks * nbytes / bandwidth_bytes_s


def at_group(tables: CostTables, group: int) -> CostTables:
    """The tables with every stage's optimizer state sharded over `group` replicas (1: `tables`)."""
    if group <= 1:
        return tables
    classes = tuple(_class_at(c, tables, group) for c in tables.classes)
    return dataclasses.replace(tables, classes=classes)


def _class_at(table: ClassTable, tables: CostTables, z: int) -> ClassTable:
    state, opt = [], []
    for b, (nbytes, step_s) in enumerate(zip(table.state_bytes, table.optimizer_s)):
        state.append(nbytes - moment_bytes(nbytes, table.precision) * (1 - 1 / z))
        params = tables.grad_bytes[b]           # fp32 bytes of the block's parameters (one shard's, under TP)
        # the program gathers each parameter tensor from its owner (torch's ZeroRedundancyOptimizer broadcasts
        # per tensor): the volume once, a latency per tensor
        tensors = tables.param_tensors[b] if tables.param_tensors else 1
        opt.append(step_s / z + allgather_s(params, z, tables.inter_bandwidth_bytes_s, 0.0)
                   + tensors * tables.inter_latency_s * (1.0 if z > 1 else 0.0))
    tied = tuple((a, b, n - moment_bytes(n, table.precision) * (1 - 1 / z)) for a, b, n in table.tied_state)
    # a tied parameter is one tensor: stepped and gathered once, as a block's share above prices it
    # (table.tied_optimizer_s holds the pairs of tables.tied in its order: costmodel.tables.tied_pairs)
    gathered_s = [allgather_s(nbytes, z, tables.inter_bandwidth_bytes_s, 0.0) + tables.inter_latency_s
                  for _, _, nbytes in reader_pairs(tables.tied)]
    tied_opt = tuple((a, b, step_s / z + gather_s)
                     for (a, b, step_s), gather_s in zip(table.tied_optimizer_s, gathered_s))
    return dataclasses.replace(table, state_bytes=tuple(state), optimizer_s=tuple(opt), zero_group=z, tied_state=tied,
                               tied_optimizer_s=tied_opt)
