"""Which gradient compressors a stage has the memory for.

PowerSGD keeps its error feedback and P/Q factors, 1-bit compression two error buffers
(costmodel.compression's table): state that every member of a group holds beside its stage's
training state and activations. A compressor may only be chosen for a group whose members all have
that state free, by the one memory rule (costmodel.memory.fits):

    need (state + kept activations + framework) + compressor state <= capacity

The search decides it per stage of each candidate configuration, from the stage's peak need under
its schedule (planner.search.compressors), before the solve: the sync time it charges is the best
compressor among those that fit (costmodel.compression.group_sync_s), and assembly records, for
each gradient group, the best among those that fit every member (`choose_gradient(allowed=...)`).

A stage's compressor state is bounded here by the sum over its blocks of each block's state, a tied
parameter (one tensor several blocks read) counted once per stage that holds it, so that any groups a
rank joins, each with a compressor that fits, fit together: state is additive over parameters, and
1-bit's per parameter is at least PowerSGD's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel import memory
from costmodel.compression import compress_volume, compression_of, gradient_options
from costmodel.tables import CostTables


@dataclass(frozen=True)
class StateTable:
    """Per gradient compressor a policy allows: its state bytes summed over blocks (prefix sums)."""

    names: tuple[str, ...]
    prefix_bytes: tuple[np.ndarray, ...]     # per name: [0, state(block 0), state(0..1), ...]
    # a tied parameter's consecutive readers (costmodel.tables.tied_pairs) with one copy's state per name: a
    # stage holding both counts it once
    tied: tuple[tuple[int, int, tuple[float, ...]], ...] = ()

    def state_bytes(self, name: str, blocks: range) -> float:
        """State of compressor `name` over a stage of `blocks` (see the module docstring)."""
        i = self.names.index(name)
        prefix = self.prefix_bytes[i]
        copies = sum(copy[i] for a, b, copy in self.tied if a in blocks and b in blocks)
        return float(prefix[blocks.stop] - prefix[blocks.start]) - copies

    def fitting(self, blocks: range, need_bytes: float, capacity_bytes: float) -> tuple[str, ...]:
        """The compressors whose state over `blocks` fits beside a stage needing `need_bytes` on a device
        of `capacity_bytes`; stateless ones always (the stage's own fit is the split's business)."""
        out = []
        for name in self.names:
            state = self.state_bytes(name, blocks)
            if state == 0.0 or memory.fits(need_bytes + state, capacity_bytes):
                out.append(name)
        return tuple(out)


def state_table(tables: CostTables) -> StateTable | None:
    """The state of every compressor the gradient policy allows, per block; None without gradient
    compression (nothing to decide)."""
    table = compression_of(tables)
    if not table.compresses_gradients:
        return None
    names = gradient_options(table.gradient_policy)
    volumes = [table.blocks_volume(range(b, b + 1), tables.grad_bytes) for b in range(tables.num_blocks)]
    prefix = []
    for name in names:
        per_block = [compress_volume(name, v).state_bytes for v in volumes]
        prefix.append(np.concatenate([[0.0], np.cumsum(per_block)]))
    tied: list[tuple[int, int, tuple[float, ...]]] = []
    for (readers, nbytes), param in zip(tables.tied, table.tied_params()):
        copy = tuple(compress_volume(name, table.volume([param], nbytes)).state_bytes for name in names)
        tied.extend((readers[i], readers[i + 1], copy) for i in range(len(readers) - 1))
    return StateTable(tuple(names), tuple(prefix), tuple(tied))
