"""Which link each cut of a pipeline crosses, as assemble places pipelines on the nodes, and how
activations are compressed on it."""

from __future__ import annotations

from typing import NamedTuple

from costmodel.activation_compression import CutCodec
from costmodel.compression import compression_of
from costmodel.tables import CostTables


class Cut(NamedTuple):
    """One cut between consecutive stages: the link it crosses and, where the activation policy
    compresses, how (planner.search.split prices each transfer with the compressor it picks)."""

    bandwidth_bytes_s: float
    latency_s: float
    codec: CutCodec | None = None     # None: activations travel as they are


# per cut between stages s and s+1: a Cut, or a plain (bandwidth bytes/s, latency s) pair
Links = tuple[Cut | tuple[float, float], ...]


def cut_links(tables: CostTables, classes: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
    """The link each cut between consecutive stages crosses, as planner.search.assemble places a
    pipeline: a class's run of stages inside one node when it fits there, else over whole nodes in
    stage order (a cut crosses the network where one node ends); a cut between classes crosses
    the network."""
    inter = (tables.inter_bandwidth_bytes_s, tables.inter_latency_s)
    out, start = [], 0
    for s in range(len(classes) - 1):
        if classes[s + 1] != classes[s]:
            out.append(inter)
            start = s + 1
            continue
        table = tables.classes[classes[s]]
        run = classes.count(classes[s])
        across = run > table.per_node and (s + 1 - start) % table.per_node == 0
        out.append(inter if across else (table.intra_bandwidth_bytes_s, table.intra_latency_s))
    return tuple(out)


def cuts(tables: CostTables, classes: tuple[int, ...]) -> tuple[Cut, ...]:
    """`cut_links` with each cut's activation compression: the tables' activation policy and the
    kernel figures of the cut's slower end (none where the policy is `none`)."""
    compression = compression_of(tables)
    policy = compression.activation_policy
    out = []
    for s, (bandwidth, latency) in enumerate(cut_links(tables, classes)):
        codec = None
        if policy != "none":
            ends = (classes[s], classes[s + 1])
            codec = CutCodec(policy, min(compression.kernel_bandwidth_bytes_s[c] for c in ends),
                             max(compression.kernel_launch_s[c] if compression.kernel_launch_s else 0.0
                                 for c in ends))
        out.append(Cut(bandwidth, latency, codec))
    return tuple(out)
