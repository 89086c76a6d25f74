"""Which link each cut of a pipeline crosses, as assemble places pipelines on the nodes."""

from __future__ import annotations

from costmodel.tables import CostTables
from planner.search.split import Links


def cut_links(tables: CostTables, classes: tuple[int, ...]) -> Links:
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
