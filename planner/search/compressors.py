"""Which gradient compressors each stage of a candidate configuration may use: those whose state
(PowerSGD's P/Q and error feedback, 1-bit's error buffers) fits beside the stage's peak memory
under its schedule, by the one memory rule (costmodel.compression_memory).

The search decides it once per configuration, before the solve (`with_compressor_room`); the sync
time it charges for the configuration's stages is the best compressor among those
(planner.search.sync), and assembly gives each gradient group the best compressor among those every
member's stage allows (`group_allowed`), by the same function (costmodel.compression.choose_gradient)
on the same inputs. A plan that compresses therefore records each rank's compressor state within
its device's memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from costmodel.compression_memory import state_table
from costmodel.tables import CostTables
from planner.search.candidates import Config
from planner.search.schedules import peak_need_bytes


def with_compressor_room(tables: CostTables, configs: list[Config]) -> list[Config]:
    """`configs` with each stage's fitting gradient compressors decided (unchanged without gradient
    compression)."""
    states = state_table(tables)
    if states is None:
        return configs
    out = []
    for c in configs:
        need = peak_need_bytes(tables, c)
        bounds = c.split.bounds
        room = tuple(states.fitting(range(bounds[s], bounds[s + 1]), need[s], tables.classes[ci].capacity_bytes)
                     for s, ci in enumerate(c.classes))
        out.append(dataclasses.replace(c, stage_compressors=room))
    return out


def stage_allowed(config: Config, stage: int) -> frozenset[str] | None:
    """The gradient compressors stage `stage` of `config` has the memory for (None: any)."""
    if config.stage_compressors is None:
        return None
    return frozenset(config.stage_compressors[stage])


def group_allowed(members: Iterable[Collection[str] | None]) -> frozenset[str] | None:
    """The compressors a gradient group may use: those every member's stage allows (None: any)."""
    out: frozenset[str] | None = None
    for allowed in members:
        if allowed is not None:
            out = frozenset(allowed) if out is None else out & frozenset(allowed)
    return out
