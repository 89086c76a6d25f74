"""Aligned gradient groups across replicas of different shapes.

Replicas synchronise a parameter's gradient with every other replica holding it. When two
replicas cut the blocks at different places, their stages overlap partially and the gradient
groups fragment into chains (stage a1 syncs with b1 and b2, b2 with a1 and a2, ...) that run one
after another: the sync costs far more than one all-reduce of the heaviest stage. So the search
only combines splits whose cut points are nested (one's cuts a subset of the other's; equal cuts
included): then every coarse stage syncs with whole finer stages, at most one all-reduce of its
own bytes, as the sync term charges.

So the splits are few and shared: per stage count one split for every class (the contiguous
split minimising the worst class's slowest stage relative to that class's own best,
split.solve_shared_bounds, balanced at the micro-batch size that loses least throughput under
the 1F1B schedule, or the equal split where that loses less), used at
every micro-batch size where it fits in memory; a class it does not fit gets its own split (at the
middle size, else at the size itself, with recompute when nothing else fits). Few distinct splits
keep the CP-SAT model as small as one without alignment.
"""

from __future__ import annotations

from costmodel import memory
from costmodel.tables import CostTables
from planner.search.pipeline import pipeline_one_s
from planner.search.split import Lane, Split, equal_bounds, solve_shared_bounds, solve_split, stage_costs
from planner.search.topology import cuts

Bounds = tuple[int, ...]
# a candidate split's throughput is taken at up to this many micro-batches (planner.search.pipeline's
# cost is linear in it; beyond it the pipeline is in steady state and the slowest stage decides)
RATE_MAX_MICRO = 64


def nested(a: Bounds, b: Bounds) -> bool:
    """Cut points of one split are a subset of the other's: their gradient groups stay aligned."""
    sa, sb = set(a), set(b)
    return sa <= sb or sb <= sa


def conflicts(bounds: list[Bounds]) -> list[tuple[int, int]]:
    """Pairs of (indices into `bounds`) that may not be used together."""
    return [(i, j) for i in range(len(bounds)) for j in range(i + 1, len(bounds))
            if not nested(bounds[i], bounds[j])]


def split_for(tables: CostTables, cls: int, bounds: Bounds, micro_batch: int, recompute: bool) -> Split | None:
    """`bounds` costed on class `cls` at `micro_batch`; None when a stage does not fit its memory."""
    table = tables.classes[cls]
    split = stage_costs(table, bounds, micro_batch, cuts(tables, (cls,) * (len(bounds) - 1)), tables.grad_bytes,
                        recompute)
    return split if all(memory.fits(m, table.capacity_bytes) for m in split.stage_memory_bytes) else None


def own_split(tables: CostTables, cls: int, num_stages: int, micro_batch: int) -> Split | None:
    """The class's best split at this micro-batch size; with recompute only when nothing else fits."""
    links = cuts(tables, (cls,) * num_stages)
    table = tables.classes[cls]
    return (solve_split(table, num_stages, micro_batch, links, tables.grad_bytes)
            or solve_split(table, num_stages, micro_batch, links, tables.grad_bytes, recompute=True))


OwnSplits = dict[tuple[int, int], "Split | None"]     # (class, micro-batch size) -> own_split


def own_splits(tables: CostTables, classes: list[int], num_stages: int, micro_options: list[int]) -> OwnSplits:
    return {(ci, m): own_split(tables, ci, num_stages, m) for ci in classes for m in micro_options}


def shared_bounds(tables: CostTables, classes: list[int], num_stages: int, micro_options: list[int],
                  own: OwnSplits) -> Bounds | None:
    """One split for `classes`: among the shared splits balanced at each micro-batch size and the
    split into equal block counts, the one whose worst class loses least throughput against the
    best candidate for that class (`_rate`: the 1F1B schedule's time, so a split that puts its
    slowest stages first beats an equally balanced one that puts them last). Classes that make
    the balanced split infeasible are left out, smallest memory first (they get their own splits)."""
    candidates = {b for m in micro_options if (b := _shared_at(tables, classes, num_stages, m, own)) is not None}
    if not candidates:
        return None
    candidates.add(equal_bounds(tables.num_blocks, num_stages))
    rates = {(ci, b): _rate(tables, ci, b, micro_options) for ci in classes for b in candidates}
    best_rate = {ci: max(rates[(ci, b)] for b in candidates) for ci in classes}

    def loss(bounds: Bounds) -> float:
        worst = 0.0
        for ci in classes:
            if best_rate[ci] > 0.0:
                rate = rates[(ci, bounds)]
                worst = max(worst, best_rate[ci] / rate if rate > 0 else float("inf"))
        return worst

    return min(sorted(candidates), key=loss)


def _rate(tables: CostTables, cls: int, bounds: Bounds, micro_options: list[int]) -> float:
    """Samples per second of one replica of `cls` cut at `bounds`, at the micro-batch size where its
    slowest stage serves most samples per second, running the whole batch (at least S and at most
    RATE_MAX_MICRO micro-batches) under 1F1B (planner.search.pipeline): the fill and drain count,
    and where the slow stages sit."""
    fitting = [(split, m) for m in micro_options if (split := split_for(tables, cls, bounds, m, True)) is not None]
    if not fitting:
        return 0.0
    split, m = max(fitting, key=lambda pair: pair[1] / pair[0].max_stage_s)
    return split_rate(tables, split, m)


def split_rate(tables: CostTables, split: Split, micro_batch: int) -> float:
    """Samples per second of one replica running the batch in `micro_batch`-sample micro-batches
    (at least S and at most RATE_MAX_MICRO of them) under 1F1B."""
    micro_batches = min(RATE_MAX_MICRO, max(split.num_stages, -(-tables.global_batch // micro_batch)))
    return micro_batches * micro_batch / pipeline_one_s(split.fwd_s, split.bwd_s, split.send_s, micro_batches)


def _shared_at(tables: CostTables, classes: list[int], num_stages: int, micro_batch: int,
               own: OwnSplits) -> Bounds | None:
    lanes = []
    for ci in classes:
        split = own[(ci, micro_batch)]
        if split is not None:
            lanes.append(Lane(tables.classes[ci], cuts(tables, (ci,) * num_stages), split.recompute,
                              max(split.max_stage_s, 1e-12)))
    lanes.sort(key=lambda ln: -ln.table.model_bytes)
    while lanes:
        bounds = solve_shared_bounds(lanes, num_stages, micro_batch)
        if bounds is not None:
            return bounds
        lanes.pop()
    return None


def class_splits(tables: CostTables, cls: int, num_stages: int, micro_options: list[int],
                 shared: Bounds | None, own: OwnSplits) -> list[tuple[int, Split]]:
    """(micro-batch size, split) of one class and stage count: the shared split where it fits (with
    recompute if need be), else the class's own split at the middle size where that fits, else its
    own at the size."""
    reference = own[(cls, micro_options[len(micro_options) // 2])]
    out = []
    for m in micro_options:
        for bounds, recompute in ((shared, True), *([(reference.bounds, reference.recompute)] if reference else [])):
            split = split_for(tables, cls, bounds, m, recompute) if bounds else None
            if split is not None:
                break
        else:
            split = own[(cls, m)]
        if split is not None:
            out.append((m, split))
    return out
