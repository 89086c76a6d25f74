"""Interleaved 1F1B configurations: for a single-class 1F1B pipeline of D devices, the same D devices each
running v stages of a split into K = v D stages (stage k on device k mod D), where every device holds
what it must.

The split is the bottleneck partition (planner.search.split) of the class's blocks into K stages with each
cut priced on the link it crosses: device k mod D to the next, the last device back to the first, inside a
node where the D devices are. Memory is checked per device afterwards: its v stages' training state and
the activations the interleaved schedule keeps in flight on it, its warm-up of (v - 1) rounds and
2 (D - 1 - d) forwards (planner.core.schedule), each with the activations of the stage that ran it. The
gradient groups are the K stages'; the ILP keeps splits that do not nest apart (planner.search.align).

Where interleaving is asked for (`--schedule interleaved`, and a layout the user gives), a device whose
stages do not fit so recomputes all of them (Megatron's full recompute inside interleaved pipelines; the
open search offers no such twin, see `with_interleaved`): each micro-batch in flight then keeps only its
stage input, and one micro-batch's activations are rebuilt during its backward, at a second forward's time.
Recompute is decided per device, not per stage: a device's in-flight micro-batches are its chunks' together,
so what fits is the device's. The split is the one made without recompute (the devices that recompute are
slower by their second forwards; the bottleneck split does not see that). Stages do not compress their
gradients here (one rank then runs several gradient groups, which the compressors' state is not priced for).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from costmodel import memory
from costmodel.compression import compression_of
from costmodel.tables import ClassTable, CostTables
from planner.core import schedule as sched
from planner.search.candidates import Config
from planner.search.split import costs_per_stage, solve_split, stage_transient_bytes
from planner.search.topology import Cut, Links

CHUNK_OPTIONS = (2, 4)           # stages per device offered to the search
SATURATED_ROUNDS = 4             # a count of this many rounds holds every device's whole warm-up


def device_splits(stages: int) -> list[tuple[int, int]]:
    """The (devices, chunks) a pipeline of `stages` stages can interleave over: at least two devices."""
    return [(stages // v, v) for v in CHUNK_OPTIONS if stages % v == 0 and stages // v >= 2]


def with_interleaved(tables: CostTables, configs: list[Config], fixed_stages: int | None = None,
                     micro_options: Sequence[int] = (), recompute: bool = False) -> list[Config]:
    """For each single-class 1F1B pipeline of D >= 2 devices (class, depth, micro-batch size),
    its interleaved twins with v of CHUNK_OPTIONS stages per device, where the blocks are enough for v D
    stages and every device holds its stages; with `fixed_stages` K (`--stages`: the pipeline's stages),
    those of K stages on K / v devices instead, at each of `micro_options` (K may exceed the devices, so
    that no 1F1B pipeline of K stages exists). With `recompute` (interleaving asked for: `--schedule
    interleaved`), a device that holds its stages only so recomputes them.

    The open search offers no recomputing twin: a model whose pipelines must recompute makes nearly every
    1F1B shape a parent of one, and walking their schedules (planner.search.interleave) at every count made
    the search at 1024 GPUs five times slower (Llama-2-70B, 2.7 -> 13-15 s), for twins that pay a second
    forward on every stage of a device to shorten a fill."""
    if compression_of(tables).compresses_gradients:
        return []
    twins = []
    if fixed_stages is None:
        shapes = {(c.cls, c.num_stages, c.micro_batch, v): None for c in configs
                  if c.schedule == "1f1b" and not c.stage_classes and c.num_stages >= 2 for v in CHUNK_OPTIONS}
    else:
        shapes = {(ci, d, m, v): None for ci, table in enumerate(tables.classes)
                  for m in micro_options for d, v in device_splits(fixed_stages)
                  if d <= table.num_devices}
    for cls, devices, micro_batch, chunks in shapes:
        if devices * chunks <= tables.num_blocks:
            twin = interleaved(tables, cls, devices, chunks, micro_batch, recompute=recompute)
            if twin is not None:
                twins.append(twin)
    return twins


def interleaved(tables: CostTables, cls: int, devices: int, chunks: int, micro_batch: int,
                bounds: tuple[int, ...] | None = None, recompute: bool = True) -> Config | None:
    """Class `cls`'s blocks in `devices` x `chunks` stages on `devices` devices under interleaved 1F1B: the
    best split, where every device holds its stages (else None), the devices that hold them only so
    recomputing (none without `recompute`); or the split `bounds` given, as it is (a layout the user wrote:
    what does not fit even recomputing is reported with the plan, planner.search.given)."""
    table, K = tables.classes[cls], devices * chunks
    links = device_cuts(table, tables, devices, K)
    given = bounds is not None
    if bounds is None:
        unbounded = dataclasses.replace(table, capacity_bytes=math.inf)    # memory is the device's, below
        best = solve_split(unbounded, K, micro_batch, links, tables.grad_bytes)
        if best is None:
            return None
        bounds = best.bounds
    plain = device_need_bytes(table, bounds, micro_batch, devices, chunks)
    recomputing = tuple(recompute and not memory.fits(n, table.capacity_bytes) for n in plain)   # per device
    need = device_need_bytes(table, bounds, micro_batch, devices, chunks, recomputing) if any(recomputing) \
        else plain
    if not given and not all(memory.fits(n, table.capacity_bytes) for n in need):
        return None
    split = costs_per_stage([table] * K, bounds, micro_batch, links, tables.grad_bytes,
                            recompute=tuple(recomputing[k % devices] for k in range(K)))
    split = dataclasses.replace(split, stage_memory_bytes=tuple(need[k % devices] for k in range(K)), optimal=True)
    optimizer_s = max(table.held_optimizer_s(range(split.bounds[k], split.bounds[k + 1]) for k in range(d, K, devices))
                      for d in range(devices))
    return Config(cls, K, micro_batch, split, optimizer_s, devices <= table.per_node,
                  schedule="interleaved", chunks=chunks)


def device_cuts(table: ClassTable, tables: CostTables, devices: int, stages: int) -> Links:
    """The link each of the K - 1 cuts crosses, stage k on device k mod D placed as assemble places D
    devices (inside one node when they fit, else whole nodes in order): a cut from a node's last device to
    the next device, or from the last device back to the first, crosses the network where D spans nodes."""
    inter = Cut(tables.inter_bandwidth_bytes_s, tables.inter_latency_s)
    intra = Cut(table.intra_bandwidth_bytes_s, table.intra_latency_s)
    out: list[Cut] = []
    for k in range(stages - 1):
        d = k % devices
        out.append(inter if devices > table.per_node and (d + 1) % table.per_node == 0 else intra)
    return tuple(out)


def device_need_bytes(table: ClassTable, bounds: tuple[int, ...], micro_batch: int, devices: int,
                      chunks: int, recomputing: tuple[bool, ...] | None = None) -> list[float]:
    """Per device: its stages' training state, the most activations the interleaved schedule keeps on it at
    once (its stages' kept bytes per micro-batch in flight, counted action by action), one micro-batch's
    backward working set (its largest stage's) and the framework's memory. A device of `recomputing` keeps
    its stage input per micro-batch in flight instead (the largest boundary, as split.costs_per_stage), and
    one micro-batch's activations of its largest stage while that one is recomputed (costmodel.memory)."""
    K = devices * chunks
    kept = [sum(table.act_bytes[bounds[k]:bounds[k + 1]]) for k in range(K)]       # per sample
    acts = [a * micro_batch for a in kept]
    out = []
    for d, counts in enumerate(in_flight_counts(devices, chunks)):
        own = range(d, K, devices)
        working = max(stage_transient_bytes(table, bounds[k], bounds[k + 1]) for k in own)
        if recomputing is not None and recomputing[d]:      # the one rule of a recomputing stage's activations
            activations = memory.kept_activation_bytes(max(kept[k] for k in own), max(table.boundary_bytes), working,
                                                       micro_batch, max(sum(v) for v in counts), True)
        else:
            peak = max(sum(n * acts[c * devices + d] for c, n in enumerate(vector)) for vector in counts)
            activations = peak + working * micro_batch
        state = table.held_state_bytes(range(bounds[k], bounds[k + 1]) for k in own)
        out.append(memory.need_bytes(state, activations, table.framework_bytes))
    return out


@functools.lru_cache(maxsize=256)
def in_flight_counts(devices: int, chunks: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per device: the micro-batches in flight on each of its chunks after each forward of the saturated
    schedule (SATURATED_ROUNDS rounds), only those no other vector covers chunk by chunk: whatever each
    chunk keeps per micro-batch, the device's peak is one of them. The walk is the schedule's own, made
    once per devices x chunks instead of once per split."""
    schedule = sched.interleaved(devices, chunks, SATURATED_ROUNDS * devices)
    out = []
    for actions in schedule:
        live = [0] * chunks
        seen: set[tuple[int, ...]] = set()
        for a in actions:
            live[a.stage // devices] += 1 if a.kind == "F" else -1
            if a.kind == "F":
                seen.add(tuple(live))
        out.append(tuple(v for v in seen
                         if not any(w != v and all(x >= y for x, y in zip(w, v)) for w in seen)))
    return tuple(out)
