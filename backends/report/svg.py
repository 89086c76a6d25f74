"""The HTML report's drawings, as inline SVG: the cluster, the simulated timeline, memory per device.

Every name from a spec or a plan is escaped (`esc`): a node group named `<script>` is text. Large
plans stay readable: replicas with identical work share one block of timeline rows and one group
of memory bars (`x N`), and the cluster picture wraps nodes into rows that scroll.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from backends.report.text import GIB, format_time, printable, stage_ranks
from backends.sim.engine import OPTIMIZER_LABEL, SYNC_LABEL, SimResult, Span
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan, ReplicaPlan
from planner.core.units import BYTES_S_PER_GBYTE_S

TIMELINE_WIDTH_PX = 1000     # at zoom 1; the page's zoom control scales it
ROW_PX = 16
LABEL_PX = 260
CELL_PX = 18                 # one device in the cluster picture
NODES_PER_ROW = 8
BAR_PX = 800                 # a device's full capacity in the memory chart
UNUSED = "#d9d9d9"
SYNC_COLOUR = "#5b7fa6"
OPTIMIZER_COLOUR = "#e08a2c"


def esc(text: object) -> str:
    """Text for HTML: markup characters escaped, control characters shown as escapes (as on a terminal)."""
    return html.escape(printable(str(text)), quote=True)


def replica_colour(replica: int, stage: int, num_stages: int, backward: bool = False) -> str:
    """One hue per replica (golden-angle steps), lighter for later stages, darker for backward."""
    hue = (replica * 137.508) % 360
    light = 38 + (30 * stage / max(num_stages - 1, 1) if num_stages > 1 else 15)
    return f"hsl({hue:.0f},62%,{light - 14 if backward else light:.0f}%)"


@dataclass(frozen=True)
class ReplicaGroup:
    """Replicas of identical work: drawn once, labelled with how many there are."""

    first: ReplicaPlan
    count: int


def replica_groups(plan: Plan) -> list[ReplicaGroup]:
    """Replicas grouped by what they run (node group, stages' blocks, micro-batches, schedule)."""
    groups: dict[tuple, list[ReplicaPlan]] = {}
    for r in plan.replicas:
        key = (r.node_group, tuple((s.first_block, s.last_block, s.device_type) for s in r.stages),
               r.micro_batch_sizes, r.schedule)
        groups.setdefault(key, []).append(r)
    return [ReplicaGroup(rs[0], len(rs)) for rs in groups.values()]


def cluster_svg(plan: Plan, spec: ClusterSpec) -> str:
    """Nodes as boxes of device cells, coloured by replica and stage; links labelled with bandwidth."""
    by_device = {d: (r, st, rank) for r in plan.replicas for st in r.stages for rank, d, _ in st.rank_devices()}
    devices = spec.devices()
    nodes: dict[int, list] = {}
    for d in devices:
        nodes.setdefault(d.node, []).append(d)
    parts, y = [], 0
    for group in spec.nodes:
        group_nodes = [n for n, ds in nodes.items() if ds[0].group == group.name]
        intra = group.intra_link
        parts.append(f'<text x="0" y="{y + 14}" class="h">{esc(group.name)}: {group.count} x {group.per_node} '
                     f'{esc(group.device.name)}, intra-node {esc(intra.kind)} '
                     f'{intra.bandwidth_bytes_s / BYTES_S_PER_GBYTE_S:g} GB/s</text>')
        y += 22
        node_w = group.per_node * CELL_PX + 8
        for i, node in enumerate(group_nodes):
            col, row = i % NODES_PER_ROW, i // NODES_PER_ROW
            x0, y0 = col * (node_w + 10), y + row * (CELL_PX + 14)
            parts.append(f'<rect class="node" x="{x0}" y="{y0}" width="{node_w}" height="{CELL_PX + 8}" rx="3"/>')
            for d in nodes[node]:
                fill, tip = UNUSED, f"{d.label} ({d.type.name}): unused"
                if d.index in by_device:
                    r, st, rank = by_device[d.index]
                    fill = replica_colour(r.index, st.index, len(r.stages))
                    tip = (f"{d.label} ({d.type.name}): rank {rank}, replica {r.index} stage {st.index}, "
                           f"blocks {st.first_block}-{st.last_block}")
                parts.append(f'<rect class="device" x="{x0 + 4 + d.local * CELL_PX}" y="{y0 + 4}" '
                             f'width="{CELL_PX - 2}" height="{CELL_PX}" fill="{fill}"><title>{esc(tip)}</title></rect>')
        y += (len(group_nodes) + NODES_PER_ROW - 1) // NODES_PER_ROW * (CELL_PX + 14) + 8
    net = spec.inter_node
    parts.append(f'<text x="0" y="{y + 14}" class="h">network between nodes: {esc(net.kind)} '
                 f'{net.bandwidth_bytes_s * 8 / 1e9:g} Gbit/s, {net.latency_s * 1e6:g} us</text>')
    width = max(NODES_PER_ROW * (max(g.per_node for g in spec.nodes) * CELL_PX + 18), 600)
    return _svg("cluster", width, y + 24, parts)


def _span_colour(span: Span, replica: ReplicaPlan) -> str:
    if span.label.startswith(SYNC_LABEL):
        return SYNC_COLOUR
    if span.label == OPTIMIZER_LABEL:
        return OPTIMIZER_COLOUR
    stage = int(span.label[:-len(span.label.lstrip("0123456789"))] or 0)
    return replica_colour(replica.index, stage, len(replica.stages), backward="B" in span.label or "W" in span.label)


def _describe(span: Span) -> str:
    label = span.label
    if label.startswith(SYNC_LABEL):
        what = f"gradient sync, group {label[len(SYNC_LABEL):]}"
    elif label == OPTIMIZER_LABEL:
        what = "optimizer step"
    else:
        kind = "forward" if "F" in label else "weight gradients" if "W" in label else "backward"
        stage, micro = label.split(kind[0].upper())
        what = f"stage {stage} {kind}, micro-batch {micro}"
    return f"{what}: {format_time(span.end_s - span.start_s)} from {format_time(span.start_s)}"


def timeline_svg(plan: Plan, sim: SimResult) -> str:
    """One row per stage of each group of identical replicas (its tensor-parallel shards alike); hover a bar
    for its action and time."""
    by_rank: dict[int, list[Span]] = {}
    for sp in sim.timeline:
        by_rank.setdefault(sp.rank, []).append(sp)
    scale = TIMELINE_WIDTH_PX / sim.iteration_s if sim.iteration_s > 0 else 0.0
    parts, y = [], 0
    for group in replica_groups(plan):
        r = group.first
        times = f" (x{group.count} identical replicas)" if group.count > 1 else ""
        parts.append(f'<text x="0" y="{y + 12}" class="h">replica {r.index}{times}: {esc(r.node_group)}, '
                     f'{len(r.stages)} stage(s), share {r.batch_share}, {esc(r.schedule)}</text>')
        y += ROW_PX + 2
        for st in r.stages:
            # a stage's tensor-parallel shards run alike (one row, its ranks named)
            ranks = stage_ranks(st)
            parts.append(f'<text x="0" y="{y + 12}" class="lbl">rank {ranks} stage {st.index} '
                         f'{esc(st.device_label)}</text>')
            for sp in by_rank.get(st.rank, []):
                x, w = LABEL_PX + sp.start_s * scale, max((sp.end_s - sp.start_s) * scale, 0.5)
                parts.append(f'<rect class="span" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_PX - 3}" '
                             f'fill="{_span_colour(sp, r)}"><title>rank {st.rank}: {esc(_describe(sp))}'
                             f'</title></rect>')
            y += ROW_PX
        y += 6
    axis = (f'<text x="{LABEL_PX}" y="{y + 12}" class="lbl">0</text><text x="{LABEL_PX + TIMELINE_WIDTH_PX}" '
            f'y="{y + 12}" class="lbl axis-end" text-anchor="end">{format_time(sim.iteration_s)}</text>')
    return _svg("timeline", LABEL_PX + TIMELINE_WIDTH_PX + 10, y + 20, [*parts, axis],
                extra=f'data-time-left="{LABEL_PX}"')


MEMORY_PARTS = ("weights", "gradients", "optimizer state", "activations", "compressor state", "framework")
MEMORY_COLOURS = ("#4e79a7", "#59a14f", "#9c755f", "#f28e2b", "#b07aa1", "#bab0ac")


@dataclass(frozen=True)
class MemoryRow:
    label: str
    count: int                              # identical devices the row stands for
    parts_bytes: tuple[float, ...]          # in MEMORY_PARTS order
    capacity_bytes: float


def memory_svg(rows: Sequence[MemoryRow]) -> str:
    """Stacked bars per device (or group of identical devices) against its capacity."""
    parts, y = [], 0
    for i, (name, colour) in enumerate(zip(MEMORY_PARTS, MEMORY_COLOURS)):
        parts.append(f'<rect x="{LABEL_PX + i * 130}" y="2" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{LABEL_PX + i * 130 + 16}" y="13" class="lbl">{name}</text>')
    y = 24
    for row in rows:
        scale = BAR_PX / row.capacity_bytes if row.capacity_bytes > 0 else 0.0
        times = f" x{row.count}" if row.count > 1 else ""
        used = sum(row.parts_bytes)
        parts.append(f'<text x="0" y="{y + 12}" class="lbl">{esc(row.label)}{times}</text>'
                     f'<rect class="capacity" x="{LABEL_PX}" y="{y}" width="{BAR_PX}" height="{ROW_PX - 2}"/>')
        x = float(LABEL_PX)
        for name, colour, nbytes in zip(MEMORY_PARTS, MEMORY_COLOURS, row.parts_bytes):
            w = min(nbytes * scale, LABEL_PX + BAR_PX - x)
            if w > 0:
                parts.append(f'<rect class="mem" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_PX - 2}" '
                             f'fill="{colour}"><title>{esc(row.label)}: {name} {nbytes / GIB:.3f} GiB</title></rect>')
            x += max(w, 0.0)
        parts.append(f'<text x="{LABEL_PX + BAR_PX + 6}" y="{y + 12}" class="lbl">{used / GIB:.2f} / '
                     f'{row.capacity_bytes / GIB:.1f} GiB ({used / row.capacity_bytes:.0%})</text>')
        y += ROW_PX + 2
    return _svg("memory", LABEL_PX + BAR_PX + 160, y + 4, parts)


def _svg(name: str, width: float, height: float, parts: list[str], extra: str = "") -> str:
    return (f'<svg id="{name}-svg" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'data-base-width="{width:.0f}" {extra}>' + "".join(parts) + "</svg>")
