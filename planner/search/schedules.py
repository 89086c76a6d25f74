"""Which pipeline schedule each configuration may run: 1F1B, GPipe, or both for the search to choose.

Both run the same stages and split; they differ in time (planner.search.pipeline: GPipe streams its
forwards and its backwards, so transfers that are long against compute overlap better than under
1F1B's alternation) and in memory (1F1B holds at most S - s micro-batches' activations on stage s,
GPipe all M). A GPipe configuration therefore carries the most micro-batches its stages hold.
"""

from __future__ import annotations

import dataclasses
import math

from costmodel import memory
from costmodel.tables import ClassTable, CostTables
from planner.search.candidates import Config
from planner.search.pipeline import DEFAULT_MAX_MICRO
from planner.search.split import kept_activation_bytes


def with_schedules(tables: CostTables, configs: list[Config], schedule: str) -> list[Config]:
    """The 1F1B configurations as asked by `schedule`: kept ("1f1b"), each with a GPipe twin where
    GPipe holds at least two micro-batches ("auto"; with one both run the same), or the GPipe twins
    alone where GPipe holds one ("gpipe")."""
    if schedule == "1f1b":
        return configs
    twins = []
    for c in configs:
        most = gpipe_max_micro_batches(tables, c)
        if most >= (1 if schedule == "gpipe" else 2):
            twins.append(dataclasses.replace(c, schedule="gpipe", max_micro_batches=most))
    return twins if schedule == "gpipe" else configs + twins


def gpipe_max_micro_batches(tables: CostTables, config: Config) -> int:
    """The most micro-batches whose activations every stage of `config` holds at once (GPipe's peak),
    with the stage's training state, in its device's memory (the memory rule, solved for the count)."""
    sp, m = config.split, config.micro_batch
    most = DEFAULT_MAX_MICRO
    for s, ci in enumerate(config.classes):
        table, blocks = tables.classes[ci], range(sp.bounds[s], sp.bounds[s + 1])
        recompute = sp.stage_recompute[s]
        state = table.held_state_bytes([blocks])
        fixed = state + kept_activation_bytes(table, blocks, m, 0, recompute)
        each = kept_activation_bytes(table, blocks, m, 1, recompute) - kept_activation_bytes(
            table, blocks, m, 0, recompute)
        if each > 0:
            count = math.floor((table.model_bytes - fixed) / each)
            while count > 0 and not memory.fits(stage_need_bytes(table, blocks, m, count, recompute),
                                                table.capacity_bytes):
                count -= 1     # the division rounded up past the rule
            most = min(most, count)
    return most


def stage_need_bytes(table: ClassTable, blocks: range, micro_batch: int, in_flight: int, recompute: bool) -> float:
    """A stage's peak need before compressor state (costmodel.memory.need_bytes) with `in_flight`
    micro-batches' activations kept."""
    return memory.need_bytes(table.held_state_bytes([blocks]),
                             kept_activation_bytes(table, blocks, micro_batch, in_flight, recompute),
                             table.framework_bytes)


def peak_need_bytes(tables: CostTables, config: Config) -> tuple[float, ...]:
    """Per stage of `config`: its need at its schedule's peak before compressor state; 1F1B holds
    S - s micro-batches on stage s (the split's figure), GPipe as many as it may run."""
    sp = config.split
    if config.schedule != "gpipe" or config.max_micro_batches is None:
        return sp.stage_memory_bytes
    return tuple(stage_need_bytes(tables.classes[ci], range(sp.bounds[s], sp.bounds[s + 1]), config.micro_batch,
                                  config.max_micro_batches, sp.stage_recompute[s])
                 for s, ci in enumerate(config.classes))
