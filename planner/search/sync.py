"""Gradient sync time of one pipeline split replicated R times: what the search charges.

Every stage all-reduces the gradients of its own parameters with the same stage of the other
replicas. A parameter read by blocks of several stages (tied weights, e.g. an embedding reused as
the output head) has a group of its own over every holder of every replica, which each holder
runs before or after its own group: one more collective on that rank's path. The sync time is the
slowest stage's: its own group plus each of its tied groups, each a ring all-reduce or, under a
compression policy, the best compressor the policy allows among those whose state fits every holder
(costmodel.compression.group_sync_s; the configuration's `stage_compressors`,
planner.search.compressors): the compressor assembly records for that group.

Splits whose cuts do not nest (the ILP never combines them, planner.search.align; the metis baseline
may) fragment the groups into a chain that runs one group after another: `chained_sync_end_s` times
that chain, group by group, as the simulator runs it (the baselines charge it).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from costmodel.compression import compression_of, group_sync_s
from costmodel.tables import CostTables
from planner.core.cluster import Link
from planner.search.compressors import group_allowed


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
                 link: Link, overlap_s: Sequence[float] | None = None,
                 allowed: Sequence[Collection[str] | None] | None = None, chunks: int = 1) -> list[float]:
    """For each replica count: the sync time left after the pipeline ends, the slowest stage's (its
    own group, then its tied groups), less the stage's `overlap_s` (drain_overlap_s) where given.
    A stage with tied groups waits for every holder, so it overlaps only as much as the earliest
    holder in the pipeline (the one that finishes last). `allowed`: per stage, the gradient
    compressors whose state it has the memory for (Config.stage_compressors; None: any).

    Under interleaved 1F1B (`chunks` stages per device, stage k on device k mod D) a device runs the groups
    of its stages one after another once its last backward ends: the slowest device's sum, less the
    device's `overlap_s` (then given per device)."""
    parts = stage_sync_parts(tables, bounds)
    S = len(parts)
    devices = S // chunks
    overlap = list(overlap_s) if overlap_s is not None else [0.0] * (devices if chunks > 1 else S)
    holders = _tied_holders(tables, bounds)
    device_of = [s % devices for s in range(S)]
    on_device = [overlap[device_of[s]] for s in range(S)] if chunks > 1 else overlap
    start = [min([on_device[s]] + [on_device[h] for h in holders[s]]) for s in range(S)]
    # a stage syncing fewer bytes and starting no earlier than another untied stage is never slowest
    # (ring all-reduces; compressors differ per stage in what they save and in whether they fit); under
    # interleaving every stage counts towards its device's sum
    every = compression_of(tables).compresses_gradients or chunks > 1
    candidates = [s for s in range(S) if parts[s][1] or every]
    best_overlap = float("inf")
    for s in sorted((s for s in range(S) if not (parts[s][1] or every)), key=lambda s: (-parts[s][0], start[s])):
        if start[s] < best_overlap:
            candidates.append(s)
            best_overlap = start[s]
    fitting = list(allowed) if allowed is not None else [None] * S
    own_params, tied_groups = _group_params(tables, bounds)
    per_stage: dict[int, list[float]] = {}
    for s in candidates:
        own_bytes, tied = parts[s]
        own = group_sync_s(tables, cls, own_params[s], own_bytes, replica_counts, link, fitting[s])
        tied_s = [group_sync_s(tables, cls, params, nbytes, [holders_n * R for R in replica_counts], link,
                               group_allowed(fitting[h] for h in holder_stages))
                  for (nbytes, holders_n), (params, holder_stages) in zip(tied, tied_groups[s])]
        per_stage[s] = [own[i] + sum(times[i] for times in tied_s) for i in range(len(replica_counts))]
    worst = [0.0] * len(replica_counts)
    if chunks > 1:
        for d in range(devices):
            mine = [s for s in per_stage if device_of[s] == d]
            begin = min(start[s] for s in mine)
            for i in range(len(replica_counts)):
                worst[i] = max(worst[i], sum(per_stage[s][i] for s in mine) - begin)
        return worst
    for s, times in per_stage.items():
        for i in range(len(replica_counts)):
            worst[i] = max(worst[i], times[i] - start[s])
    return worst


def _group_params(tables: CostTables, bounds: tuple[int, ...],
                  ) -> tuple[list[list[str]], list[list[tuple[list[str], set[int]]]]]:
    """Per stage: the parameters of its own group, and per tied group it joins (in stage_sync_parts'
    order) the tied parameter and its holder stages; empty without gradient compression (the ring
    all-reduce needs bytes only)."""
    S = len(bounds) - 1
    compression = compression_of(tables)
    stage_of = {b: s for s in range(S) for b in range(bounds[s], bounds[s + 1])}
    names = compression.tied_params() if compression.compresses_gradients else ()
    tied: list[list[tuple[list[str], set[int]]]] = [[] for _ in range(S)]
    shared: set[str] = set()
    for i, (blocks, _) in enumerate(tables.tied):
        holders = {stage_of[b] for b in blocks}
        if len(holders) > 1:
            name = names[i] if i < len(names) else f"tied.{i}"   # unknown: costed as a vector of its bytes
            shared.add(name)
            for h in sorted(holders):
                tied[h].append(([name], holders))
    own: list[list[str]] = [[] for _ in range(S)]
    if compression.compresses_gradients and compression.block_params:
        for s in range(S):
            params = dict.fromkeys(p for b in range(bounds[s], bounds[s + 1]) for p in compression.block_params[b])
            own[s] = [p for p in params if p not in shared]
    return own, tied


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


@dataclass(frozen=True)
class SyncLane:
    """Identical replicas of one split, as the gradient groups of splits that do not nest see them."""

    cls: int
    bounds: tuple[int, ...]
    replicas: int
    ready_s: tuple[float, ...]          # per stage: when its last backward ends (pipeline's clock)
    allowed: tuple[Collection[str] | None, ...] | None = None   # per stage: Config.stage_compressors

    def allowed_at(self, stage: int) -> Collection[str] | None:
        """The compressors stage `stage` has the memory for (None: any)."""
        return self.allowed[stage] if self.allowed is not None else None


def chained_sync_end_s(tables: CostTables, lanes: Sequence[SyncLane], link: Link) -> list[list[float]]:
    """Per lane, per stage: when its last gradient group ends, the groups run as the program issues them.

    Splits whose cuts do not nest (planner.search.align) fragment the groups: one group per set of
    holders, a run of blocks no lane cuts or a tied parameter over every stage holding it (groups with
    the same holders are one), issued in the order of their ranks (each lane's ranks in stage order,
    lanes in the order given), each starting once every member stage is free and holding all of them
    (backends/sim). So a stage that spans several of another split's stages waits for each in turn.
    Each group costs what split_sync_s charges a group: a ring all-reduce, or the compressor the policy
    allows (costmodel.compression.group_sync_s) among those every member has the memory for."""
    compression = compression_of(tables)
    named = compression.compresses_gradients
    stage_of = [[0] * tables.num_blocks for _ in lanes]
    for li, lane in enumerate(lanes):
        for s in range(len(lane.bounds) - 1):
            for b in range(lane.bounds[s], lane.bounds[s + 1]):
                stage_of[li][b] = s
    groups: dict[tuple[tuple[int, int], ...], tuple[float, list[str]]] = {}

    def add(members: set[tuple[int, int]], nbytes: float, params: list[str]) -> None:
        key = tuple(sorted(members))
        held, names = groups.get(key, (0.0, []))
        groups[key] = (held + nbytes, names + [p for p in params if p not in names])

    tied_names = compression.tied_params() if named else ()
    shared: set[str] = set()
    for i, (blocks, nbytes) in enumerate(tables.tied):
        name = tied_names[i] if i < len(tied_names) else f"tied.{i}"
        shared.add(name)
        add({(li, stage_of[li][b]) for li in range(len(lanes)) for b in blocks}, nbytes, [name] if named else [])
    cuts = sorted({c for lane in lanes for c in lane.bounds})
    for lo, hi in zip(cuts, cuts[1:]):
        own = sum(tables.grad_bytes[lo:hi]) - sum(nbytes for blocks, nbytes in tables.tied for b in blocks
                                                   if lo <= b < hi)
        params = [p for b in range(lo, hi) for p in compression.block_params[b] if p not in shared] \
            if named and compression.block_params else []
        add({(li, stage_of[li][lo]) for li in range(len(lanes))}, max(own, 0.0), list(dict.fromkeys(params)))
    free = {(li, s): lane.ready_s[s] for li, lane in enumerate(lanes) for s in range(len(lane.ready_s))}
    for members, (nbytes, params) in sorted(groups.items()):
        ranks = sum(lanes[li].replicas for li, _ in members)
        if ranks <= 1:      # held by one rank: nothing to synchronise
            continue
        allowed = group_allowed(lanes[li].allowed_at(s) for li, s in members)
        duration = group_sync_s(tables, lanes[members[0][0]].cls, params, nbytes, [ranks], link, allowed)[0]
        end = max(free[m] for m in members) + duration
        for m in members:
            free[m] = end
    return [[free[(li, s)] for s in range(len(lane.ready_s))] for li, lane in enumerate(lanes)]
