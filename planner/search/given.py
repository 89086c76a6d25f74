"""A layout the user gave (planner.frontend.layout), built into the records every strategy builds:
one candidates.Config per replica (its stages' classes, block bounds, micro-batch size, schedule), costed
by split.costs_per_stage on the tables at the layout's tensor-parallel degree (costmodel.tensor_parallel,
as planner.search.degrees prices a degree) and ZeRO group, estimated by baselines.evaluate as the
baselines' fixed layouts are. The caller assembles the solution with the one `assemble()`.

Nothing is chosen here that the layout says; what it leaves out gets the defaults the frontend states.
Stages recompute exactly where their activations do not fit otherwise (as the search's splits do; under
interleaved 1F1B, every stage of a device that does not fit otherwise, planner.search.interleave_configs).
A stage that does not fit even so is no error here: the plan records its memory, and the caller reports
it (`overs`).

Names: a replica's `devices` name node groups (first) or device types of the spec; a type with several
groups takes the first with room. Layers: the model's repeated-layer index of each block, from the
parameters it reads (`blocks.3.attn.weight` -> layer 3 of stack `blocks`, the stack with the most
numbered children), else from its label; a stage of layers a-b starts at layer a's first block (the
first stage at block 0: what comes before the first layer, an embedding, goes with it) and ends where
the next stage starts (the last at the model's end: the head goes with the last layer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NoReturn

from costmodel import memory, sharded_state, tensor_parallel
from costmodel.tables import CostTables
from planner.core.blocks import Block
from planner.core.errors import OptionError, SpecError
from planner.core.ir import Plan
from planner.frontend.layout import DeviceChoice, Layout, ReplicaLayout, Shorthand, StageRange
from planner.search import baselines, candidates, interleave, topology
from planner.search.compressors import with_compressor_room
from planner.search.degrees import ZERO_MAX_GROUP
from planner.search.interleave_configs import interleaved
from planner.search.schedules import under_zero_bubble
from planner.search.split import costs_per_stage, equal_bounds

GIVEN_STATUS = "GIVEN"           # the user's layout: nothing searched, no bound (gap 100%)
_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Given:
    """The layout as the search's records: the solution and the tables it is priced on."""

    solution: candidates.Solution
    tables: CostTables
    replicas: tuple[ReplicaLayout, ...]      # the layout's replicas, the shorthand's spelled out


@dataclass(frozen=True)
class Over:
    """A rank whose stage needs more memory than its device offers (after the memory margin)."""

    replica: int
    stage: int
    rank: int
    device: str
    need_bytes: float
    capacity_bytes: float

    @property
    def over_bytes(self) -> float:
        return self.need_bytes - self.capacity_bytes


def build(layout: Layout, tables: CostTables, blocks: list[Block]) -> Given:
    """The layout's solution on `tables` (degree 1, with the layout's policies); raises SpecError or
    OptionError naming the layout's field when the cluster or the model does not have what it names."""
    replicas = spell_out(layout.shorthand, tables) if layout.shorthand else layout.replicas
    degrees = {r.tp for r in replicas}
    if len(degrees) > 1:
        _fail(layout, replicas[[r.tp for r in replicas].index(sorted(degrees)[-1])].where + ".tp",
              f"tensor-parallel degrees {sorted(degrees)} differ between replicas",
              "give every replica one degree: a gradient group sums one shard of a parameter in every replica")
    degree = degrees.pop()
    at_t = tensor_parallel.at_degree(tables, tables.shardings, degree)
    if degree > 1 and not any(sh.divides(degree) and sh.sharded_params for sh in tables.shardings):
        _fail(layout, replicas[0].where + ".tp", f"no block of the model shards at degree {degree}",
              "use tp: 1, or a degree the model's layer widths divide")
    if layout.zero:
        at_t = sharded_state.at_group(at_t, zero_group(len(replicas)))
    shares = _shares(layout, replicas, tables.global_batch)
    layers = block_layers(blocks)
    room = [c.num_devices for c in at_t.classes]
    out: list[baselines.Replica] = []
    for r, share in zip(replicas, shares):
        count = stage_count(r)
        bounds = _bounds(layout, r, count, tables.num_blocks, layers)
        devices = _classes(layout, r, at_t, room, count // r.chunks)
        m = _micro_batch(layout, r, share, count)
        if r.chunks > 1:
            out.append((_interleaved(layout, r, at_t, devices, bounds, m, share), share))
        else:
            out.append((_config(at_t, devices, bounds, m, r.schedule, math.ceil(share / m)), share))
    return Given(baselines.evaluate(at_t, out, status=GIVEN_STATUS), at_t, tuple(replicas))


def zero_group(replicas: int) -> int:
    """ZeRO-1's group: the largest power of two up to ZERO_MAX_GROUP and the replica count."""
    group = 1
    while group * 2 <= min(ZERO_MAX_GROUP, replicas):
        group *= 2
    return group


def overs(plan: Plan) -> list[Over]:
    """Every rank that needs more than its device offers by the one memory rule, most over first."""
    e = plan.estimates
    out = []
    for r in plan.replicas:
        for st in r.stages:
            for rank, _, label in st.rank_devices():
                capacity = memory.capacity_bytes(e.capacity_bytes[rank], e.memory_margin)
                if not memory.fits(e.memory_bytes[rank], capacity):
                    out.append(Over(r.index, st.index, rank, label, e.memory_bytes[rank], capacity))
    return sorted(out, key=lambda o: (-o.over_bytes, o.rank))


def block_layers(blocks: list[Block]) -> list[int | None]:
    """Per block: the index of the model's repeated layer it belongs to (None: outside the stack)."""
    found: list[list[tuple[str, int]]] = []
    indices: dict[str, set[int]] = {}
    for b in blocks:
        names = [*b.params, b.label] if b.params else [b.label]
        marks = [(m.group(1), int(m.group(2))) for m in map(_NUMBERED.match, names) if m]
        found.append(marks)
        for prefix, i in marks:
            indices.setdefault(prefix, set()).add(i)
    if not indices:
        return [None] * len(blocks)
    stack = max(indices, key=lambda p: len(indices[p]))      # first seen among equals (dicts keep order)
    return [min((i for p, i in marks if p == stack), default=None) for marks in found]


def spell_out(short: Shorthand, tables: CostTables) -> tuple[ReplicaLayout, ...]:
    """The shorthand's replicas: dp pipelines of pp stages of tp devices, equal blocks per stage, placed
    on the device classes fastest first (least forward + backward time per sample; spec order among
    equals), each pipeline on one class, as many as a class holds whole (baselines.pipelines_per_class)."""
    at_t = tensor_parallel.at_degree(tables, tables.shardings, short.tp)
    order = sorted(range(len(at_t.classes)),
                   key=lambda ci: (sum(tables.classes[ci].fwd_s) + sum(tables.classes[ci].bwd_s), ci))
    held = {ci: baselines.pipelines_per_class(at_t.classes[ci], short.pp) if at_t.classes[ci].num_devices else 0
            for ci in order}
    if sum(held.values()) < short.dp:
        offered = ", ".join(f"{at_t.classes[ci].name} {held[ci]}" for ci in order)
        raise OptionError(f"dp={short.dp} pipelines of pp={short.pp} x tp={short.tp} devices need "
                          f"{short.dp * short.pp * short.tp} devices; the cluster holds {sum(held.values())} such "
                          f"pipelines ({offered})", field="--layout dp",
                          fix="lower dp, pp or tp, or give a cluster with more devices")
    out: list[ReplicaLayout] = []
    for ci in order:
        for _ in range(min(held[ci], short.dp - len(out))):
            out.append(ReplicaLayout(DeviceChoice((tables.classes[ci].name,)), stages=short.pp * short.vpp,
                                     tp=short.tp, micro_batch=short.mb, where=f"--layout replica {len(out)}",
                                     schedule="interleaved" if short.vpp > 1 else "1f1b", chunks=short.vpp))
    return tuple(out)


def _fail(layout: Layout, where: str, message: str, fix: str) -> NoReturn:
    if layout.shorthand is not None:
        raise OptionError(message, field=f"--layout ({layout.shorthand.text})", fix=fix)
    raise SpecError(message, file=layout.source, field=where, fix=fix)


def _shares(layout: Layout, replicas: tuple[ReplicaLayout, ...], global_batch: int) -> list[int]:
    """Each replica's samples: its `share`, else micro-batch size x count, else the rest split equally."""
    given = [r.share if r.share is not None else
             (r.micro_batch * r.micro_batches if r.micro_batch and r.micro_batches else None) for r in replicas]
    fixed = sum(s for s in given if s is not None)
    free = [i for i, s in enumerate(given) if s is None]
    rest = global_batch - fixed
    if rest < len(free) or (not free and rest != 0):
        raise_at = replicas[max(i for i, s in enumerate(given) if s is not None)].where
        _fail(layout, f"{raise_at}.share", f"the replicas' shares sum to {fixed}"
              + (f" and {len(free)} replica(s) more need a sample each" if free else "")
              + f"; the global batch is {global_batch}",
              "make the shares sum to the global batch, or leave some out to split the rest")
    filled = iter(baselines.equal_shares(rest, len(free)) if free else [])
    return [s if s is not None else next(filled) for s in given]


def stage_count(r: ReplicaLayout) -> int:
    """Replica `r`'s stages: its ranges, its count, its devices over tp (times its chunks), else one."""
    return len(r.ranges) or r.stages or (r.devices.count // r.tp * r.chunks if r.devices.count else r.chunks)


def _classes(layout: Layout, r: ReplicaLayout, tables: CostTables, room: list[int], count: int) -> tuple[int, ...]:
    """The device class of each of replica `r`'s `count` devices (a stage each, but under interleaved 1F1B),
    taken from `room` (free devices per class, in units of tp devices)."""
    names = r.devices.names
    per_stage = names if len(names) == count else names * count
    known_groups = [c.name for c in tables.classes]
    known_types = sorted({c.device_type for c in tables.classes})
    out: list[int] = []
    for s, name in enumerate(per_stage):
        matches = [ci for ci, c in enumerate(tables.classes) if c.name == name] or \
                  [ci for ci, c in enumerate(tables.classes) if c.device_type == name]
        if not matches:
            _fail(layout, f"{r.where}.devices", f"the cluster has no node group or device type {name!r}",
                  f"name one of the groups {', '.join(known_groups)} or types {', '.join(known_types)}")
        ci = out[-1] if out and out[-1] in matches and room[out[-1]] > 0 else \
            next((c for c in matches if room[c] > 0), matches[0])
        if not any(tables.classes[c].num_devices for c in matches):
            _fail(layout, f"{r.where}.devices", f"{name} has no {r.tp} devices in one node for a stage of tp={r.tp}",
                  "use a tp that divides the devices per node of the group")
        if room[ci] <= 0:
            c = tables.classes[ci]
            held = f"{c.num_devices} group(s) of tp={r.tp}" if r.tp > 1 else f"{c.num_devices} device(s)"
            _fail(layout, f"{r.where}.devices", f"{name} has {held}, all taken by the stages before this "
                  f"replica's stage {s}", "use fewer stages, replicas or a smaller tp, or another group")
        room[ci] -= 1
        out.append(ci)
    return tuple(out)


def _bounds(layout: Layout, r: ReplicaLayout, num_stages: int, num_blocks: int,
            layers: list[int | None]) -> tuple[int, ...]:
    """Block bounds of replica `r`'s stages: equal blocks per stage, or its ranges."""
    if not r.ranges:
        if num_stages > num_blocks:
            _fail(layout, f"{r.where}.stages", f"{num_stages} stages for a model of {num_blocks} blocks",
                  f"give at most {num_blocks} stages")
        return equal_bounds(num_blocks, num_stages)
    first_block: dict[int, int] = {}
    for b, layer in enumerate(layers):
        if layer is not None:
            first_block.setdefault(layer, b)
    last_layer = max(first_block, default=-1)
    starts = [_start(layout, r, s, x, num_blocks, first_block, last_layer) for s, x in enumerate(r.ranges)]
    for s, x in enumerate(r.ranges):
        where = f"{r.where}.stages[{s}].{x.unit}"
        end = starts[s + 1] if s + 1 < len(starts) else num_blocks
        if x.unit == "blocks" and x.last + 1 != end:
            what = f"block {end}" if s + 1 < len(starts) else f"the model's last block, {num_blocks - 1}"
            _fail(layout, where, f"stage {s} ends at block {x.last}; the next block is {what.split(', ')[-1]}"
                  if s + 1 == len(starts) else f"stage {s} ends at block {x.last}, stage {s + 1} starts at {what}",
                  f"cover blocks 0..{num_blocks - 1} once, each stage starting where the one before ends")
        if x.unit == "layers":
            nxt = r.ranges[s + 1] if s + 1 < len(r.ranges) else None
            if nxt is None and x.last != last_layer:
                _fail(layout, where, f"the last stage ends at layer {x.last}; the model's last is {last_layer}",
                      f"end the last stage at layer {last_layer}")
            if nxt is not None and nxt.unit == "layers" and nxt.first != x.last + 1:
                _fail(layout, where, f"stage {s} ends at layer {x.last}, stage {s + 1} starts at layer {nxt.first}",
                      "cover the layers once, each stage starting where the one before ends")
        if end <= starts[s]:
            _fail(layout, where, f"stage {s} holds no block", "give every stage at least one block")
    return (*starts, num_blocks)


def _start(layout: Layout, r: ReplicaLayout, s: int, x: StageRange, num_blocks: int,
           first_block: dict[int, int], last_layer: int) -> int:
    where = f"{r.where}.stages[{s}].{x.unit}"
    if x.unit == "blocks":
        if x.last >= num_blocks:
            _fail(layout, where, f"block {x.last} is past the model's last block, {num_blocks - 1}",
                  f"number blocks 0..{num_blocks - 1} (`plan inspect` lists them)")
        if s == 0 and x.first != 0:
            _fail(layout, where, f"the first stage starts at block {x.first}", "start the first stage at block 0")
        return x.first
    if last_layer < 0:
        _fail(layout, where, "the model has no repeated layers to count", "give the stages as blocks: 0-5")
    if x.last > last_layer:
        _fail(layout, where, f"layer {x.last} is past the model's last layer, {last_layer}",
              f"number layers 0..{last_layer}")
    if s == 0 and x.first != 0:
        _fail(layout, where, f"the first stage starts at layer {x.first}", "start the first stage at layer 0")
    return 0 if s == 0 else first_block[x.first]


def _micro_batch(layout: Layout, r: ReplicaLayout, share: int, num_stages: int) -> int:
    """Micro-batch size: given (at most the share: a replica runs no more rows than it has), else the
    share over the given count, else over the stage count."""
    if r.micro_batch is not None:
        m = min(r.micro_batch, share)
        split = interleave.split_rows(num_stages // r.chunks, share, m) if r.chunks > 1 else None
        made = len(split) if split else math.ceil(share / m)
        if r.micro_batches is not None and made != r.micro_batches:
            _fail(layout, f"{r.where}.micro_batches", f"a share of {share} in micro-batches of {m} is "
                  f"{made} micro-batches, not {r.micro_batches}",
                  "give two of share, micro_batch and micro_batches, or three that agree")
        return m
    count = r.micro_batches if r.micro_batches is not None else num_stages
    return max(1, math.ceil(share / count))


def _interleaved(layout: Layout, r: ReplicaLayout, tables: CostTables, devices: tuple[int, ...],
                 bounds: tuple[int, ...], micro_batch: int, share: int) -> candidates.Config:
    """An interleaved replica's configuration (planner.search.interleave_configs), its devices of one class."""
    if len(set(devices)) > 1:
        _fail(layout, f"{r.where}.devices", "interleaved 1F1B on devices of several node groups",
              "give the replica's devices one node group or device type")
    if interleave.split_rows(len(devices), share, micro_batch) is None:
        _fail(layout, f"{r.where}.micro_batch", f"a share of {share} in micro-batches of at most {micro_batch} "
              f"fills no whole round of the interleaved schedule on {len(devices)} devices",
              f"give a share and micro_batch whose count is below {2 * len(devices)} or a multiple of "
              f"{len(devices)}")
    config = interleaved(tables, devices[0], len(devices), r.chunks, micro_batch, bounds)
    if config is None:
        _fail(layout, f"{r.where}.stages", "the stages do not split the model's blocks", "report this layout")
    return config


def _config(tables: CostTables, classes: tuple[int, ...], bounds: tuple[int, ...], micro_batch: int,
            schedule: str, micro_batches: int) -> candidates.Config:
    """The configuration of one replica, costed as the search costs its own (recompute where needed)."""
    stage_tables = [tables.classes[ci] for ci in classes]
    split = costs_per_stage(stage_tables, bounds, micro_batch, topology.cuts(tables, classes), tables.grad_bytes,
                            recompute=True)
    opt = candidates.pipeline_optimizer_s(stage_tables, bounds)
    mixed = len(set(classes)) > 1
    config = candidates.Config(classes[0], len(classes), micro_batch, split, opt,
                               intra_node=not mixed and len(classes) <= tables.classes[classes[0]].per_node,
                               stage_classes=classes if mixed else (), schedule=schedule,
                               max_micro_batches=micro_batches if schedule == "gpipe" else None)
    if schedule == "zbh1":
        config = under_zero_bubble(tables, config)
    return with_compressor_room(tables, [config])[0]
