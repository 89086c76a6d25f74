"""Which pipeline schedule each configuration may run: 1F1B, GPipe, ZB-H1, or several for the search to choose.

All run the same stages and split; they differ in time (planner.search.pipeline: GPipe streams its
forwards and its backwards, so transfers that are long against compute overlap better than under
1F1B's alternation; planner.search.zero_bubble: ZB-H1 fills the drain with weight gradients) and in
memory (1F1B holds at most S - s micro-batches' activations on stage s, GPipe all M, ZB-H1 up to S on
every stage). A GPipe configuration therefore carries the most micro-batches its stages hold, and a
ZB-H1 one exists where every stage holds S. ZB-H1 is offered on request only (README: its split backward
has a cost per micro-batch the tables do not price yet).
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
    GPipe holds at least two micro-batches ("auto"; with one both run the same), the GPipe twins
    alone where GPipe holds one ("gpipe"), or the ZB-H1 twins alone where every stage holds S
    micro-batches ("zbh1")."""
    if schedule == "1f1b":
        return configs
    if schedule == "zbh1":
        return [t for t in (zero_bubble_twin(tables, c) for c in configs) if t is not None]
    twins = []
    for c in configs:
        most = gpipe_max_micro_batches(tables, c)
        if most >= (1 if schedule == "gpipe" else 2):
            twins.append(dataclasses.replace(c, schedule="gpipe", max_micro_batches=most))
    return twins if schedule == "gpipe" else configs + twins


def zero_bubble_twin(tables: CostTables, config: Config) -> Config | None:
    """`config` under ZB-H1 where every stage holds S micro-batches' activations; else None."""
    if not tables.wgrad_fraction or config.num_stages < 2:
        return None
    twin = under_zero_bubble(tables, config)
    fits = all(memory.fits(need, tables.classes[ci].capacity_bytes)
               for need, ci in zip(peak_need_bytes(tables, twin), twin.classes))
    return twin if fits else None


def under_zero_bubble(tables: CostTables, config: Config) -> Config:
    """`config` under ZB-H1, with each stage's weight-gradient time per micro-batch (CostTables.wgrad_fraction
    of its blocks' backward); its memory as it is (a given layout's is checked apart)."""
    sp = config.split
    wgrad = tuple(sum(tables.classes[ci].bwd_s[b] * (tables.wgrad_fraction[b] if tables.wgrad_fraction else 0.0)
                      for b in range(sp.bounds[s], sp.bounds[s + 1])) * config.micro_batch
                  for s, ci in enumerate(config.classes))
    return dataclasses.replace(config, schedule="zbh1", stage_wgrad_s=wgrad)


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
    S - s micro-batches on stage s (the split's figure), GPipe as many as it may run, ZB-H1 S."""
    sp = config.split
    if config.schedule == "zbh1":
        return tuple(stage_need_bytes(tables.classes[ci], range(sp.bounds[s], sp.bounds[s + 1]), config.micro_batch,
                                      config.num_stages, sp.stage_recompute[s])
                     for s, ci in enumerate(config.classes))
    if config.schedule != "gpipe" or config.max_micro_batches is None:
        return sp.stage_memory_bytes
    return tuple(stage_need_bytes(tables.classes[ci], range(sp.bounds[s], sp.bounds[s + 1]), config.micro_batch,
                                  config.max_micro_batches, sp.stage_recompute[s])
                 for s, ci in enumerate(config.classes))
