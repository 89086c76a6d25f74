"""Pipelines across device classes: the first stages on one class's devices, the rest on another's
(e.g. a model too deep for either class alone, or leftover V100s and P100s serving one replica).

A mixed pipeline uses the stage count's shared split (planner.search.align), so its gradient
groups stay aligned with every other replica of that depth; each stage is costed on its own class
(compute, memory, precision) and the cut between the two classes crosses the network. The class
with more memory per device takes the first stages: under 1F1B they hold the most micro-batches
in flight. Portions longer than a node take whole nodes, as single-class pipelines do.
"""

from __future__ import annotations

from costmodel import memory
from costmodel.tables import CostTables
from planner.search import align
from planner.search.candidates import Config, pipeline_optimizer_s
from planner.search.split import Lane, Split, costs_per_stage, solve_mixed_bounds
from planner.search.topology import cuts


def portions(num_stages: int, first: int, second: int, tables: CostTables) -> list[int]:
    """Stage counts for the first class (the rest go to the second): half, and in proportion to
    the two classes' device counts, where each portion fits its class's devices and node shape."""
    a, b = tables.classes[first], tables.classes[second]
    options = {num_stages // 2, round(num_stages * a.num_devices / (a.num_devices + b.num_devices))}

    def placeable(count: int, per_node: int, devices: int) -> bool:
        return 1 <= count <= devices and (count <= per_node or count % per_node == 0)
    return sorted(k for k in options if placeable(k, a.per_node, a.num_devices)
                  and placeable(num_stages - k, b.per_node, b.num_devices))


def mixed_split(tables: CostTables, stage_classes: tuple[int, ...], bounds: tuple[int, ...],
                micro_batch: int) -> Split | None:
    """`bounds` with stage s on class stage_classes[s], its stages recomputing where they must; None
    when a stage does not fit its memory even so."""
    stage_tables = [tables.classes[ci] for ci in stage_classes]
    split = costs_per_stage(stage_tables, bounds, micro_batch, cuts(tables, stage_classes),
                            tables.grad_bytes, recompute=True)
    if not all(memory.fits(mem, t.capacity_bytes) for mem, t in zip(split.stage_memory_bytes, stage_tables)):
        return None
    return split


def stage_count_options(tables: CostTables, first: int, second: int) -> list[int]:
    """Depths of a mixed pipeline: powers of two from 2, and multiples of the larger node size (whole
    nodes of both), up to both classes' devices (and the blocks)."""
    a, b = tables.classes[first], tables.classes[second]
    most = min(tables.num_blocks, a.num_devices + b.num_devices)
    out, S = set(), 2
    while S <= most:
        out.add(S)
        S *= 2
    step = max(a.per_node, b.per_node)
    out.update(range(step, most + 1, step))
    return sorted(out)


def own_bounds(tables: CostTables, classes: tuple[int, ...], micro_batch: int, recompute: bool,
               ) -> tuple[int, ...] | None:
    """The mixed pipeline's own best split (for depths without a shared one that fits it)."""
    links = cuts(tables, classes)
    lanes = [Lane(tables.classes[ci], links, recompute, 1.0)
             for ci in dict.fromkeys(classes)]
    index = {ci: i for i, ci in enumerate(dict.fromkeys(classes))}
    return solve_mixed_bounds(lanes, [index[ci] for ci in classes], micro_batch)


def _splits(tables: CostTables, classes: tuple[int, ...], bounds: tuple[int, ...] | None,
            micro_options: list[int]) -> list[tuple[int, Split]]:
    """(micro-batch size, split) where `bounds` fits, with recompute where only that fits."""
    if bounds is None:
        return []
    out = []
    for m in micro_options:
        split = mixed_split(tables, classes, bounds, m)
        if split is not None:
            out.append((m, split))
    return out


def _faster(tables: CostTables, candidates: list[list[tuple[int, Split]]]) -> list[tuple[int, Split]]:
    """Per micro-batch size, the candidate split that runs the batch fastest (align.split_rate)."""
    best: dict[int, tuple[float, Split]] = {}
    for found in candidates:
        for m, split in found:
            rate = align.split_rate(tables, split, m)
            if m not in best or rate > best[m][0]:
                best[m] = (rate, split)
    return [(m, split) for m, (_, split) in sorted(best.items())]


def pairs(tables: CostTables) -> list[tuple[int, int]]:
    """(first, second) class pairs: the one with more memory per device first; both orders when
    their memory is the same (then speed per block decides, and each order is costed)."""
    out = []
    n = len(tables.classes)
    for a in range(n):
        for b in range(a + 1, n):
            ca, cb = tables.classes[a].model_bytes, tables.classes[b].model_bytes
            if abs(ca - cb) <= 0.01 * max(ca, cb):
                out += [(a, b), (b, a)]
            else:
                out.append((a, b) if ca > cb else (b, a))
    return out


def mixed_configs(tables: CostTables, shared: dict[int, tuple[int, ...]], micro_options: list[int],
                  fixed_stages: int | None = None) -> list[Config]:
    """Mixed pipelines over every pair of classes: the depth's shared split where it fits them,
    else their own split."""
    out = []
    for first, second in pairs(tables):
        for S in stage_count_options(tables, first, second):
            if fixed_stages is not None and S != fixed_stages:
                continue
            for k in portions(S, first, second, tables):
                classes = (first,) * k + (second,) * (S - k)
                found = _splits(tables, classes, shared.get(S), micro_options)
                # unless the shared split fits every micro-batch size without recompute: the pipeline's
                # own too, balanced at the middle size, else at the smallest (least activation memory),
                # with recompute where needed or without; per size the one that runs the batch fastest
                for m_ref in dict.fromkeys((micro_options[len(micro_options) // 2], micro_options[0])):
                    if len(found) == len(micro_options) and not any(split.recompute for _, split in found):
                        break
                    found = _faster(tables, [found, *(_splits(tables, classes, own_bounds(tables, classes, m_ref, rc),
                                                              micro_options) for rc in (False, True))])
                for m, split in found:
                    opt = pipeline_optimizer_s([tables.classes[c] for c in classes], split.bounds)
                    out.append(Config(first, S, m, split, opt, False, classes))
    return out
