"""Exact enumeration of the ILP's decision space on small instances: the optimum the CP-SAT model
must reach, computed without a solver.

The space is the one of planner.search.ilp: for each device class a multiset of replica shapes
(stage count S, micro-batch size m, micro-batch count M) using at most its devices, each with the
exact split of (class, S, m) (split.solve_split, via build_configs). The objective is
ilp.solve_regime's, in the same integer nanoseconds:

    T_pipe = max over used items of ns(the 1F1B makespan with M micro-batches + optimizer)
    T_sync = max over used (class, S) shapes of ns(sync(split(shape), grid_ceil(R), link))
    minimise T_pipe + T_sync, best of the two topology regimes

where R counts all replicas, grid_ceil rounds R up to ilp.replica_grid, sync is
planner.search.sync.split_sync_s (the shape's slowest stage, tied groups included), and link is
the network (spread regime) or the class's intra-node link (one-node regime: one class only, and
each shape's replicas fit in one node). Splits used together must have nested cuts
(planner.search.align): the enumeration runs per maximal family of such splits.

Enumerating multisets item by item grows too fast even at six devices, so the enumeration runs
over (replica counts per shape, pipeline time level) instead, which is exact: with the shapes'
replica counts fixed, sync is fixed, and for a time level T the best any replica of a shape can
do is the largest capacity among that shape's items no slower than T. So for each vector of
counts the optimum is the smallest level T at which those capacities cover the global batch
(and every used shape has an item no slower than T). tests/test_enumerate.py checks this against
literal multiset enumeration on tiny cases.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from costmodel.tables import CostTables
from planner.core.cluster import Link
from planner.core.errors import PlanningError
from planner.core.units import NS_PER_S
from planner.search import align, candidates, ilp
from planner.search.compressors import group_allowed
from planner.search.configs import overlap_of
from planner.search.sync import split_sync_s

MAX_ASSIGNMENTS = 2_000_000      # replica-count vectors per regime; beyond this, use the ILP
MAX_MICRO_BATCHES = 256          # ilp.pareto_items' default bound on M

Shape = tuple[int, ...]          # the device class of each device, -chunks under interleaving (Config.shape)


@dataclass(frozen=True)
class Item:
    """One way to run a replica: configuration `config` with M micro-batches."""

    config: int
    micro_batches: int
    time_ns: int
    capacity: int


@dataclass(frozen=True)
class ExactResult:
    objective_s: float
    pipeline_s: float
    sync_s: float
    one_node: bool
    choices: tuple[candidates.Choice, ...]
    assignments: int                 # replica-count vectors examined, both regimes


def to_ns(seconds: float) -> int:
    """Seconds to integer nanoseconds, rounded as the ILP does."""
    return max(0, round(seconds * NS_PER_S))


def all_items(tables: CostTables, configs: list[candidates.Config], max_micro: int = MAX_MICRO_BATCHES) -> list[Item]:
    """Every (configuration, micro-batch count) the ILP may use, before any thinning."""
    B = tables.global_batch
    items = []
    for k, c in enumerate(configs):
        for M in c.micro_batch_counts(B, max_micro):
            items.append(Item(k, M, c.replica_time_ns(M), min(M * c.micro_batch, B)))
    return items


def shape_splits(configs: list[candidates.Config], items: list[Item]) -> dict[Shape, tuple[int, ...]]:
    """The split of each shape (within one family of nested splits a shape has one)."""
    return {configs[it.config].shape: configs[it.config].split.bounds for it in items}


def shape_room(configs: list[candidates.Config], items: list[Item], shape: Shape,
               ) -> list[frozenset[str] | None] | None:
    """Per stage of `shape`: the gradient compressors every configuration of it has the memory for
    (planner.search.compressors; None: not restricted). The enumeration charges a shape one sync, so
    where its configurations differ (memory-tight stages) it takes the most constrained one, an
    upper bound on the ILP's, which charges each its own."""
    rooms = [configs[it.config].stage_compressors for it in items if configs[it.config].shape == shape]
    if all(r is None for r in rooms):
        return None
    stages = len(next(r for r in rooms if r is not None))
    return [group_allowed(frozenset(r[s]) for r in rooms if r is not None) for s in range(stages)]


def split_families(configs: list[candidates.Config], items: list[Item]) -> list[frozenset[tuple[int, ...]]]:
    """Maximal sets of splits that may be used together (pairwise nested cuts, planner.search.align). Only
    the exact strategy asks, so networkx is imported here, not at start-up: the trace's torch.export imports
    it too, but after the model file has loaded much of what it needs (at 1024 GPUs 0.09 s there instead of
    0.18 s at start-up)."""
    import networkx as nx

    splits = sorted({configs[it.config].split.bounds for it in items}, key=lambda b: (len(b), b))
    graph = nx.Graph()
    graph.add_nodes_from(range(len(splits)))
    graph.add_edges_from((i, j) for i in range(len(splits)) for j in range(i + 1, len(splits))
                         if align.nested(splits[i], splits[j]))
    return [frozenset(splits[i] for i in clique) for clique in nx.find_cliques(graph)]


def _count_vectors(shapes: list[Shape], devices: list[int], exact: bool) -> list[tuple[int, ...]]:
    """Replica counts per shape using at most (`exact`: exactly) each class's `devices`."""
    use = [[shape.count(ci) for ci in range(len(devices))] for shape in shapes]
    out: list[tuple[int, ...]] = []

    def extend(i: int, left: list[int], prefix: tuple[int, ...]) -> None:
        if i == len(shapes):
            if not exact or not any(left):
                out.append(prefix)
                if len(out) > MAX_ASSIGNMENTS:
                    raise PlanningError(f"exact enumeration would examine over {MAX_ASSIGNMENTS:,} replica-count "
                                        "vectors", fix="use --strategy ilp on instances this large")
            return
        most = min(left[ci] // k for ci, k in enumerate(use[i]) if k)
        for n in range(most + 1):
            extend(i + 1, [l - n * k for l, k in zip(left, use[i])], (*prefix, n))
    extend(0, list(devices), ())
    return out


def _grid_index(grid: list[int]) -> list[int]:
    """For each replica count R (index), the index of the first grid point >= R."""
    index, g = [0] * (grid[-1] + 1), 0
    for R in range(1, grid[-1] + 1):
        while grid[g] < R:
            g += 1
        index[R] = g
    return index


def _capacity_by_level(items: list[Item], configs: list[candidates.Config], shapes: list[Shape], levels: np.ndarray,
                       ) -> tuple[np.ndarray, list[list[Item | None]], np.ndarray]:
    """cap[h, l]: the largest capacity of shape h among its items no slower than levels[l]; best[h][l]:
    that item; first_level[h]: the level of the shape's fastest item."""
    cap = np.zeros((len(shapes), len(levels)), dtype=np.int64)
    best: list[list[Item | None]] = [[None] * len(levels) for _ in shapes]
    first_level = np.zeros(len(shapes), dtype=np.int64)
    for h, shape in enumerate(shapes):
        mine = sorted((it for it in items if configs[it.config].shape == shape),
                      key=lambda it: (it.time_ns, -it.capacity, it.config, it.micro_batches))
        first_level[h] = int(np.searchsorted(levels, mine[0].time_ns))
        top: Item | None = None
        i = 0
        for l, t in enumerate(levels):
            while i < len(mine) and mine[i].time_ns <= t:
                if top is None or mine[i].capacity > top.capacity:
                    top = mine[i]
                i += 1
            cap[h, l] = top.capacity if top else 0
            best[h][l] = top
    return cap, best, first_level


def _fits_one_node(tables: CostTables, shapes: list[Shape], counts: np.ndarray, used: np.ndarray) -> bool:
    """One class only, and all its replicas together within one node."""
    classes = {ci for h in used for ci in shapes[h] if ci >= 0}
    if len(classes) > 1:
        return False
    per_node = tables.classes[next(iter(classes))].per_node
    return sum(int(counts[h]) * candidates.shape_devices(shapes[h]) for h in used) <= per_node


def solve_exact(tables: CostTables, configs: list[candidates.Config], use_all_devices: bool = False,
                min_replicas: int = 1) -> ExactResult | None:
    """The optimum of the ILP's model by enumeration; None when nothing covers the batch. At least
    `min_replicas` replicas (ilp.solve_regime's bound: a ZeRO variant's group, planner.search.degrees).

    Splits combine only when their cuts are nested, so the enumeration runs once per maximal family
    of such splits (within a family each (class, stage count) has one split) and keeps the best."""
    every = all_items(tables, configs)
    best: ExactResult | None = None
    examined = 0
    for family in split_families(configs, every):
        items = [it for it in every if configs[it.config].split.bounds in family]
        result = _solve_family(tables, configs, items, use_all_devices, min_replicas)
        if result is None:
            continue
        examined += result.assignments
        if best is None or (to_ns(result.objective_s), to_ns(result.pipeline_s)) < \
                (to_ns(best.objective_s), to_ns(best.pipeline_s)):
            best = result
    return None if best is None else dataclasses.replace(best, assignments=examined)


def _solve_family(tables: CostTables, configs: list[candidates.Config], items: list[Item], use_all_devices: bool,
                  min_replicas: int = 1) -> ExactResult | None:
    B = tables.global_batch
    shapes = sorted({configs[it.config].shape for it in items})
    levels = np.array(sorted({it.time_ns for it in items}), dtype=np.int64)
    cap, best, first_level = _capacity_by_level(items, configs, shapes, levels)
    splits = shape_splits(configs, items)
    max_replicas = sum(t.num_devices for t in tables.classes)
    grid = ilp.replica_grid(max_replicas)
    grid_at = _grid_index(grid)
    inter = Link("inter", tables.inter_bandwidth_bytes_s, tables.inter_latency_s)

    vectors = _count_vectors(shapes, [t.num_devices for t in tables.classes], use_all_devices)

    found: tuple[int, int, int, bool, np.ndarray] | None = None   # (objective, pipe, sync, one_node, counts)
    examined = 0
    for one_node in ilp.regimes(tables, use_all_devices):
        link_of: dict[int, list[int]] = {}
        for h, shape in enumerate(shapes):
            t = tables.classes[shape[0]]
            link = t.intra_link if one_node else inter
            bounds = splits[shape]
            overlap = overlap_of(tables, configs, shape, bounds)
            room = shape_room(configs, items, shape)
            link_of[h] = [to_ns(t) for t in split_sync_s(tables, shape[0], bounds, grid, link, overlap, room,
                                                         candidates.shape_chunks(shape))]
        for vec in vectors:
            counts = np.array(vec, dtype=np.int64)
            R = int(counts.sum())
            if R == 0 or R < min_replicas:
                continue
            used = np.nonzero(counts)[0]
            if one_node and not _fits_one_node(tables, shapes, counts, used):
                continue
            examined += 1
            covered = counts @ cap >= B
            if not covered.any():
                continue
            level = max(int(np.argmax(covered)), int(first_level[used].max()))
            pipe = int(levels[level])
            sync = max(link_of[int(h)][grid_at[R]] for h in used)
            key = (pipe + sync, pipe, sync, one_node, counts)
            if found is None or key[:2] < found[:2]:
                found = key
    if found is None:
        return None
    objective, pipe, sync, one_node, counts = found
    level = int(np.searchsorted(levels, pipe))
    choices = []
    for h in np.nonzero(counts)[0].tolist():
        item = best[h][level]
        if item is None:   # a used shape always has an item at the chosen level
            raise AssertionError(f"shape {shapes[h]} has no item at level {level}")
        choices.append(candidates.Choice(configs[item.config], int(counts[h]), item.capacity))
    return ExactResult(objective / NS_PER_S, pipe / NS_PER_S, sync / NS_PER_S, one_node, tuple(choices),
                       examined)


def exact_solution(tables: CostTables, configs: list[candidates.Config],
                   use_all_devices: bool = False, min_replicas: int = 1) -> candidates.Solution | None:
    """solve_exact as a candidates.Solution, for assemble() (the `exact` strategy)."""
    result = solve_exact(tables, configs, use_all_devices, min_replicas)
    if result is None:
        return None
    return candidates.Solution(choices=result.choices, pipeline_s=result.pipeline_s, sync_s=result.sync_s,
                        objective_s=result.objective_s, bound_s=result.objective_s, status="OPTIMAL",
                        configurations=len(all_items(tables, configs)), one_node=result.one_node)
