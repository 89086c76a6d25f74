"""`launch.sh` from `plan.devices`: one torchrun agent per node, each starting the processes the plan
runs on its node.

The nodes the plan uses get node ranks 0..N-1 in node order (program.placement.planned_nodes); the
script picks the process count of its node from NODE_RANK (`case` arms) and exports the node rank as
HETPLAN_NODE_RANK, from which train.py finds its plan rank (torchrun's c10d rendezvous numbers agents
in its own order). Without NODE_RANK it runs every process on this machine (`--standalone`).

The script is shell code, so only numbers and names matching program.placement.SAFE_NAME
(`[A-Za-z0-9._+-]`) are written into it, also in comments; any other name is left out, and the
cluster's free-text name never appears.
"""

from __future__ import annotations

from planner.core.ir import Plan

from .program.placement import SAFE_NAME, PlannedNode, parse_label, planned_nodes

WITHHELD = "(name left out: not [A-Za-z0-9._+-])"


def safe(name: str) -> str:
    """`name` where it may appear in a shell script, else a note that it was left out."""
    return name if SAFE_NAME.fullmatch(name) else WITHHELD


def _node_line(node: PlannedNode) -> str:
    count = len(node.ranks)
    return (f"node {node.node} of group {safe(node.group)} ({safe(node.device_type)}): "
            f"{count} process{'es' if count != 1 else ''}, ranks {' '.join(str(int(r)) for r in node.ranks)}")


def _layout_comments(plan: Plan, nodes: list[PlannedNode]) -> list[str]:
    lines = []
    for node in nodes:
        lines.append(f"#   node rank {node.node_rank}: {_node_line(node)}")
        for local_rank, rank in enumerate(node.ranks):
            replica, stage = plan.stage_of_rank(rank)
            group, node_index, local = parse_label(stage.device_label)
            lines.append(f"#     local rank {local_rank} = rank {int(rank)} on {safe(group)}/{node_index}:{local}: "
                         f"replica {int(replica.index)} stage {int(stage.index)}/{len(replica.stages)}, blocks "
                         f"{int(stage.first_block)}-{int(stage.last_block)}, {safe(stage.precision)}")
    return lines


def launch_script(plan: Plan) -> str:
    """The text of launch.sh for `plan`."""
    nodes = planned_nodes(plan)
    world, count = int(plan.world_size), len(nodes)
    arms = [f"  {n.node_rank}) nproc={len(n.ranks)} ;;   # {_node_line(n)}" for n in nodes]
    lines = [
        "#!/usr/bin/env bash",
        f"# hetplan launcher: the plan's {world} processes on {count} node{'s' if count != 1 else ''}, "
        "one torchrun agent per node.",
        "#",
        "# One machine standing in for every node (no NODE_RANK):",
        "#   ./launch.sh --steps 20",
        "# A cluster: on each node below, with the address of node rank 0 (MASTER_PORT: 29500 unless set):",
        "#   NODE_RANK=0 MASTER_ADDR=host0 ./launch.sh --steps 20",
        "#",
        *_layout_comments(plan, nodes),
        "#",
        "# MAX_RESTARTS=N: torchrun restarts every node's workers up to N times after a failure; with",
        "# --checkpoint-every STEPS (and --checkpoint-dir on storage every node shares) they resume from",
        "# the last complete checkpoint.",
        "# torchrun numbers its agents in an order of its own: train.py finds its plan rank from",
        "# HETPLAN_NODE_RANK and LOCAL_RANK, and stops with one line if this node is not the planned one.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        "export HETPLAN_AGENT_PID=$$   # torchrun runs as this pid (exec): its workers die with it",
        'if [ -z "${NODE_RANK:-}" ]; then',
        '  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"',
        f'  exec "${{PYTHON:-python}}" -m torch.distributed.run --standalone --nproc-per-node {world} '
        '--max-restarts "${MAX_RESTARTS:-0}" train.py "$@"',
        "fi",
        'case "$NODE_RANK" in',
        *arms,
        f'  *) echo "launch.sh: NODE_RANK=$NODE_RANK is not a node rank of this plan (0..{count - 1})" >&2; '
        "exit 2 ;;",
        "esac",
        ': "${MASTER_ADDR:?launch.sh: set MASTER_ADDR to the address of node rank 0}"',
        'export HETPLAN_NODE_RANK="$NODE_RANK"',
        f'exec "${{PYTHON:-python}}" -m torch.distributed.run --nnodes {count} --nproc-per-node "$nproc" \\',
        '  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" '
        '--rdzv-id "${RDZV_ID:-hetplan}" --max-restarts "${MAX_RESTARTS:-0}" \\',
        '  train.py "$@"',
    ]
    return "\n".join(lines) + "\n"
