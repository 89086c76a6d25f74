"""The plan's layout as a table: which rank runs which replica's stage on which device, on which node.

Rank 0 prints it at start-up. Names come from the spec, so they are printed escaped (planner.core.errors.printable):
a device or group name cannot move the cursor or colour the terminal.
"""

from __future__ import annotations

from planner.core.errors import printable
from planner.core.ir import Plan

from .placement import planned_nodes

HEADER = ("rank", "node rank", "device", "type", "replica", "stage", "precision", "blocks", "micro-batches")


def rows(plan: Plan) -> list[tuple[str, ...]]:
    """One row per rank, in rank order (the columns of HEADER)."""
    node_rank = {rank: node.node_rank for node in planned_nodes(plan) for rank in node.ranks}
    out = []
    for replica in plan.replicas:
        for stage in replica.stages:
            for lane, (rank, _, label) in enumerate(stage.rank_devices()):
                shard = f" tp {lane + 1}/{stage.tp_degree}" if stage.tp_degree > 1 else ""
                out.append((str(rank), str(node_rank[rank]), printable(label), printable(stage.device_type),
                            str(replica.index), f"{stage.index}/{len(replica.stages)}{shard}",
                            stage.precision + (" +recompute" if stage.recompute else ""),
                            f"{stage.first_block}-{stage.last_block}",
                            f"{replica.batch_share} rows as {list(replica.micro_batch_sizes)} ({replica.schedule})"))
    return sorted(out, key=lambda row: int(row[0]))


def table(plan: Plan) -> str:
    """The layout table, with a title line."""
    body = [HEADER, *rows(plan)]
    widths = [max(len(row[i]) for row in body) for i in range(len(HEADER))]
    lines = [f"hetplan plan: {plan.world_size} ranks on {len(planned_nodes(plan))} node(s), global batch "
             f"{plan.global_batch}, cluster {printable(plan.inputs.cluster_name)}"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in body]
    return "\n".join(lines)
