"""Which plan rank this process is, and whether it runs where the plan put it.

The plan places rank r on the device `plan.devices[r]`, labelled `group/node:local` (node indices count
over the whole cluster). The nodes the plan uses get node ranks 0..N-1 in node order; launch.sh starts
on each node as many processes as the plan runs there and exports the node rank as HETPLAN_NODE_RANK.

torchrun's own RANK cannot be trusted to be the plan's: its c10d rendezvous orders the agents by
hostname and pid, not by `--node-rank`, and plan ranks need not be node-major. So with
HETPLAN_NODE_RANK set, the plan rank is the LOCAL_RANK-th planned process of that node, and the process
group is joined with it (process_group.init). Without it (one machine emulating the whole cluster:
`plan run`, or launch.sh without NODE_RANK) the plan rank is torchrun's RANK, and a plan of one node runs
each rank on the GPU its label names (`n/0:1`: GPU 1, also when GPU 0 was lost and re-planned without).

Before anything is built, `resolve` checks that this agent started the processes the plan runs on its
node and that the world is the plan's; `check_gpu` that a CUDA rank's GPU is the type the plan put
there (name and memory, tolerantly). A mismatch is a LaunchError: one line with the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from planner.core.cluster import parse_label
from planner.core.errors import HetplanError, printable
from planner.core.ir import Plan, StagePlan

NODE_RANK_ENV = "HETPLAN_NODE_RANK"
SAFE_NAME = re.compile(r"[A-Za-z0-9._+-]{1,64}")   # names that may be written into launch.sh
MEMORY_TOLERANCE = 0.9          # a GPU with 90% of the memory the plan counted on is accepted as that type
# GPU families the device catalog names (costmodel/catalog/devices.yaml): a planned type of one of them
# must appear in the GPU's name; other (spec-defined) names are checked by memory alone
GPU_FAMILIES = ("A100", "A10", "L4", "T4", "V100", "P100", "H100", "H200", "MI100", "MI250X", "MI250", "MI300X")


class LaunchError(HetplanError):
    """This process was not started where the plan put a rank (wrong node, count or device)."""


@dataclass(frozen=True)
class PlannedNode:
    """One node the plan uses, and the plan ranks it runs in local device order."""

    node_rank: int                  # 0..N-1 over the nodes the plan uses, in node order
    node: int                       # the cluster's node index (the label's `node`)
    group: str
    device_type: str
    local_devices: tuple[int, ...]  # the device index on the node of each process, by local rank
    ranks: tuple[int, ...]          # the plan rank of each process, by local rank


@dataclass(frozen=True)
class Placement:
    """This process in the plan."""

    rank: int
    local_rank: int
    node: PlannedNode | None        # None: one machine emulating every node
    device_index: int               # CUDA device index on this machine (on CUDA ranks)


def rank_labels(plan: Plan) -> list[str]:
    """The device label of every rank (plans written before `devices` existed: from their stages)."""
    if len(plan.devices) == plan.world_size:
        return list(plan.devices)
    return [plan.stage_of_rank(r)[1].device_label for r in range(plan.world_size)]


def planned_nodes(plan: Plan) -> list[PlannedNode]:
    """The nodes the plan uses, in node order, with their node ranks."""
    by_node: dict[int, list[tuple[int, int, str]]] = {}
    groups: dict[int, str] = {}
    for rank, label in enumerate(rank_labels(plan)):
        group, node, local = parse_label(label)
        by_node.setdefault(node, []).append((local, rank, plan.stage_of_rank(rank)[1].device_type))
        groups[node] = group
    nodes = []
    for node_rank, node in enumerate(sorted(by_node)):
        slots = sorted(by_node[node])
        nodes.append(PlannedNode(node_rank, node, groups[node], slots[0][2], tuple(s[0] for s in slots),
                                 tuple(s[1] for s in slots)))
    return nodes


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    if not value:
        return default
    if not value.isdigit():
        raise LaunchError(f"{name}={value!r} is not a number", file="launch.sh", field=name,
                          fix="start the program with ./launch.sh or `plan run`")
    return int(value)


def resolve(plan: Plan, env: Mapping[str, str] = os.environ) -> Placement:
    """This process's plan rank, from HETPLAN_NODE_RANK and LOCAL_RANK (or torchrun's RANK), checked
    against the plan's process counts (raises LaunchError)."""
    nodes = planned_nodes(plan)
    world = _int_env(env, "WORLD_SIZE", 1)
    local_rank = _int_env(env, "LOCAL_RANK", 0)
    if not env.get(NODE_RANK_ENV):
        _check_world(plan, world, "run `plan run PLAN_DIR`, or ./launch.sh without NODE_RANK on one machine")
        rank = _int_env(env, "RANK", 0)
        return Placement(rank, local_rank, None, _standalone_device(plan, nodes, rank, local_rank))
    node_rank = _int_env(env, NODE_RANK_ENV, 0)
    ranks = f"node ranks 0..{len(nodes) - 1}"
    if node_rank >= len(nodes):
        raise LaunchError(f"node rank {node_rank} is not one of the plan's {len(nodes)} nodes ({ranks})",
                          file="launch.sh", field="NODE_RANK", fix="start node k of the plan with "
                          "`NODE_RANK=k ./launch.sh`, k in " + ranks)
    node = nodes[node_rank]
    started = _int_env(env, "LOCAL_WORLD_SIZE", 1)
    if started != len(node.ranks) or local_rank >= len(node.ranks):
        others = [n.node_rank for n in nodes if len(n.ranks) == started]
        hint = f"; the plan runs {started} on node rank {others[0]}" if others else ""
        raise LaunchError(
            f"node rank {node_rank} is {describe(node)}: the plan runs {len(node.ranks)} "
            f"process{'es' if len(node.ranks) != 1 else ''} there, this agent started {started} "
            f"(LOCAL_WORLD_SIZE)", file="launch.sh", field="NODE_RANK",
            fix=f"start this node with `NODE_RANK={node_rank} ./launch.sh`{hint}")
    _check_world(plan, world, f"start each of the plan's nodes with `NODE_RANK=k ./launch.sh`, k in {ranks}")
    return Placement(node.ranks[local_rank], local_rank, node, node.local_devices[local_rank])


def _standalone_device(plan: Plan, nodes: list[PlannedNode], rank: int, local_rank: int) -> int:
    """The CUDA index of `rank` started without HETPLAN_NODE_RANK: on a plan of one node, its label's local
    index (a plan re-planned without a lost GPU 0 runs on GPUs 1.. as labelled); a machine standing in
    for several nodes numbers its devices by local rank."""
    if len(nodes) == 1 and 0 <= rank < plan.world_size:
        return parse_label(rank_labels(plan)[rank])[2]
    return local_rank


def _check_world(plan: Plan, world: int, fix: str) -> None:
    if world != plan.world_size:
        raise LaunchError(f"the plan runs {plan.world_size} processes, torchrun started {world} (WORLD_SIZE)",
                          file="launch.sh", field="WORLD_SIZE", fix=fix)


def describe(node: PlannedNode) -> str:
    """`node 3 of group a100 (A100-40GB)`, names escaped for a terminal."""
    return f"node {node.node} of group {printable(node.group)} ({printable(node.device_type)})"


def planned_on_cpu(stage: StagePlan) -> bool:
    """Whether the plan put `stage` on a CPU (a device type named CPU...)."""
    return stage.device_type.upper().startswith("CPU")


def uses_cuda(stage: StagePlan) -> bool:
    """Whether the rank of `stage` runs on CUDA: a GPU is present and the plan's device is not a CPU."""
    return torch.cuda.is_available() and not planned_on_cpu(stage)


def emulated_device_types(plan: Plan) -> list[str]:
    """The plan's device types that ranks on this machine run as CPU processes (no GPU here, `uses_cuda`):
    their timings are not the plan's devices'."""
    return list(dict.fromkeys(st.device_type for r in plan.replicas for st in r.stages
                              if not planned_on_cpu(st) and not uses_cuda(st)))


def gpu_mismatch(device_type: str, needed_bytes: float, found_name: str, found_bytes: int) -> str | None:
    """Why a GPU called `found_name` with `found_bytes` is not the planned `device_type` that must hold
    `needed_bytes` (the plan's memory for the device), or None when it is.

    Catalog families must appear in the name as a word (`A100` in `NVIDIA A100-SXM4-40GB`, not `A10`);
    memory may be a little under the plan's figure (the driver and ECC take some)."""
    family = next((f for f in GPU_FAMILIES if re.match(rf"{f}(?![0-9A-Za-z])", device_type.upper())), None)
    if family and not re.search(rf"(?<![0-9A-Za-z]){family}(?![0-9])", found_name.upper()):
        return f"a {found_name}, not a {family}"
    if found_bytes < MEMORY_TOLERANCE * needed_bytes:
        return (f"a {found_name} with {found_bytes / 2**30:.1f} GiB, less than the {needed_bytes / 2**30:.1f} "
                f"GiB the plan counts on")
    return None


def check_gpu(plan: Plan, placement: Placement) -> None:
    """On a CUDA rank: the planned local GPU exists and is of the planned type (raises LaunchError)."""
    stage = plan.stage_of_rank(placement.rank)[1]
    if not uses_cuda(stage):
        return
    where = f"rank {placement.rank} on {printable(stage.device_label)} ({printable(stage.device_type)})"
    fix = (f"start this node with the NODE_RANK of a node of {printable(stage.device_type)} GPUs, "
           "or re-plan for this machine's GPUs")
    count = torch.cuda.device_count()
    if placement.device_index >= count:
        raise LaunchError(f"{where}: the plan uses GPU {placement.device_index}, this machine has {count}",
                          file="launch.sh", field="NODE_RANK", fix=fix)
    props = torch.cuda.get_device_properties(placement.device_index)
    needed = max(plan.estimates.capacity_bytes[placement.rank], plan.estimates.memory_bytes[placement.rank])
    why = gpu_mismatch(stage.device_type, needed, props.name, int(props.total_memory))
    if why:
        raise LaunchError(f"{where}: GPU {placement.device_index} is {why}", file="launch.sh",
                          field="NODE_RANK", fix=fix)
