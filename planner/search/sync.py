"""Gradient sync time of one pipeline split replicated R times: what the search charges.

Every stage all-reduces the gradients of its own parameters with the same stage of the other
replicas. A parameter read by blocks of several stages (tied weights, e.g. an embedding reused as
the output head) has a group of its own over every holder of every replica, which each holder
runs before or after its own group: one more collective on that rank's path. The sync time is the
slowest stage's: its own group (ring, or the best compressor the policy allows,
costmodel.compression.shape_sync_s) plus each of its tied groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from costmodel.compression import shape_sync_s
from costmodel.network import ring_allreduce_s
from costmodel.tables import CostTables
from planner.core.cluster import Link


def stage_sync_parts(tables: CostTables, bounds: tuple[int, ...]) -> list[tuple[float, list[tuple[float, int]]]]:
    """Per stage: (bytes of its own group, [(bytes, holder stages) of each tied group it joins])."""
    S = len(bounds) - 1
    stage_of = [0] * tables.num_blocks
    for s in range(S):
        for b in range(bounds[s], bounds[s + 1]):
            stage_of[b] = s
    own = [sum(tables.grad_bytes[bounds[s]:bounds[s + 1]]) for s in range(S)]
    tied: list[list[tuple[float, int]]] = [[] for _ in range(S)]
    for blocks, nbytes in tables.tied:
        holders = sorted({stage_of[b] for b in blocks})
        for b in blocks:                  # the block sums count the parameter once per block
            own[stage_of[b]] -= nbytes
        for s in holders:
            if len(holders) == 1:
                own[s] += nbytes
            else:
                tied[s].append((nbytes, len(holders)))
    return [(max(own[s], 0.0), tied[s]) for s in range(S)]


def drain_overlap_s(tables: CostTables, stage_classes: Sequence[int], bounds: tuple[int, ...],
                    micro_batch: int) -> list[float]:
    """Per stage: how long before the pipeline's end it finishes its last backward (the last
    micro-batch's backward still runs through every earlier stage), so its sync may start that much
    earlier. Compute only (no transfers): a lower bound on the real overlap. `stage_classes`: the
    device class of each stage."""
    bwd = [sum(tables.classes[c].bwd_s[b] * micro_batch + tables.classes[c].overhead_s[b] / 2
               for b in range(bounds[s], bounds[s + 1])) for s, c in enumerate(stage_classes)]
    return [sum(bwd[:s]) for s in range(len(bwd))]


def split_sync_s(tables: CostTables, cls: int, bounds: tuple[int, ...], replica_counts: Sequence[int],
                 link: Link, overlap_s: Sequence[float] | None = None) -> list[float]:
    """For each replica count: the sync time left after the pipeline ends, the slowest stage's (its
    own group, then its tied groups), less the stage's `overlap_s` (drain_overlap_s) where given.
    A stage with tied groups waits for every holder, so it overlaps only as much as the earliest
    holder in the pipeline (the one that finishes last)."""
    parts = stage_sync_parts(tables, bounds)
    S = len(parts)
    overlap = list(overlap_s) if overlap_s is not None else [0.0] * S
    holders = _tied_holders(tables, bounds)
    start = [min([overlap[s]] + [overlap[h] for h in holders[s]]) for s in range(S)]
    # a stage syncing fewer bytes and starting no earlier than another untied stage is never slowest
    candidates = [s for s in range(S) if parts[s][1]]
    best_overlap = float("inf")
    for s in sorted((s for s in range(S) if not parts[s][1]), key=lambda s: (-parts[s][0], start[s])):
        if start[s] < best_overlap:
            candidates.append(s)
            best_overlap = start[s]
    worst = [0.0] * len(replica_counts)
    for s in candidates:
        own_bytes, tied = parts[s]
        own = shape_sync_s(tables, cls, [range(bounds[s], bounds[s + 1])], own_bytes, replica_counts, link)
        for i, R in enumerate(replica_counts):
            t = own[i] + sum(ring_allreduce_s(nbytes, holders_n * R, link) for nbytes, holders_n in tied)
            worst[i] = max(worst[i], t - start[s])
    return worst


def _tied_holders(tables: CostTables, bounds: tuple[int, ...]) -> list[set[int]]:
    """Per stage: the other stages it shares a tied parameter with."""
    S = len(bounds) - 1
    stage_of = {b: s for s in range(S) for b in range(bounds[s], bounds[s + 1])}
    out: list[set[int]] = [set() for _ in range(S)]
    for blocks, _ in tables.tied:
        holders = {stage_of[b] for b in blocks}
        if len(holders) > 1:
            for h in holders:
                out[h] |= holders - {h}
    return out
