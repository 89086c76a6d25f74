"""What the simulator needs from a plan, as plain numbers: per-micro-batch compute and transfer
times per stage, gradient-sync durations per group, optimizer time per rank.

`from_plan(plan, spec)` derives them from the plan's stage records (per-sample forward/backward
times, per-micro-batch launch overhead), its point-to-point edges and gradient groups, and the
links of the cluster spec the plan was made for. A compressed edge costs what the search priced for
the compressor it records: its wire bytes over the link plus its encode/decode kernels
(costmodel.activation_compression.activation_cost). Tests build a `SimInput` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel import compute
from costmodel import constants as C
from costmodel.activation_compression import activation_cost
from costmodel.compression import INT8_BLOCK_ELEMS, kernel_bandwidth_bytes_s
from costmodel.network import ring_allreduce_s
from costmodel.sharded_state import allgather_s
from planner.core.cluster import ClusterSpec, Device, Link
from planner.core.errors import PlanningError
from planner.core.ir import GradGroup, P2PEdge, Plan, ReplicaPlan, StagePlan

# costmodel.compute.ops_overhead_s counts one launch per op forward and one backward, so the
# per-micro-batch overhead of a stage splits evenly between its F and B actions.
FORWARD_OVERHEAD_FRACTION = 0.5
# A stage's plan record charges recompute as a second forward: fwd_s_per_sample is doubled
# (split.block_time_s). The re-run forward happens inside the backward, with its launches.
RECOMPUTE_FORWARD_COPIES = 2.0


@dataclass(frozen=True)
class StageWork:
    """One rank's work in one iteration; tuples are indexed by micro-batch."""

    rank: int
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    send_fwd_s: tuple[float, ...]   # activations to the next stage (empty on the last stage)
    send_bwd_s: tuple[float, ...]   # input gradients to the previous stage (empty on the first)
    optimizer_s: float
    # the weight gradients' part of each backward (zbh1 runs it apart, as W); () where not split
    wgrad_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class ReplicaWork:
    index: int
    schedule: str                    # "1f1b" | "gpipe" | "interleaved" | "zbh1"
    stages: tuple[StageWork, ...]
    chunks: int = 1                  # stages per device (interleaved): stage k on the device of stage k mod devices

    @property
    def num_micro(self) -> int:
        return len(self.stages[0].fwd_s) if self.stages else 0


@dataclass(frozen=True)
class SyncWork:
    """One gradient group's collective: starts once every member rank is free, blocks them all."""

    group: int
    ranks: tuple[int, ...]
    duration_s: float


@dataclass(frozen=True)
class SimInput:
    world_size: int
    global_batch: int
    replicas: tuple[ReplicaWork, ...]
    syncs: tuple[SyncWork, ...]


def slowest_link(spec: ClusterSpec, devices: list[Device]) -> Link:
    """The slowest hop of a ring over `devices`: the network when they span nodes, plus the
    intra-node link of every node holding two or more of them (least bandwidth, then most latency)."""
    by_node: dict[int, list[Device]] = {}
    for d in devices:
        by_node.setdefault(d.node, []).append(d)
    links = [spec.link_between(ds[0], ds[1]) for ds in by_node.values() if len(ds) > 1]
    if len(by_node) > 1:
        links.append(spec.inter_node)
    if not links:   # a single device: no hop at all
        return spec.link_between(devices[0], devices[0])
    return min(links, key=lambda link: (link.bandwidth_bytes_s, -link.latency_s))


def _compute_times(stage: StagePlan, rows: tuple[int, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Forward and backward seconds per micro-batch of `rows` samples."""
    fwd_per_sample, extra_per_sample = stage.fwd_s_per_sample, 0.0
    fwd_over = stage.overhead_s * FORWARD_OVERHEAD_FRACTION
    bwd_over = stage.overhead_s - fwd_over
    if stage.recompute:
        fwd_per_sample = stage.fwd_s_per_sample / RECOMPUTE_FORWARD_COPIES
        extra_per_sample = stage.fwd_s_per_sample - fwd_per_sample
        bwd_over += fwd_over
    fwd = tuple(fwd_per_sample * r + fwd_over for r in rows)
    bwd = tuple((stage.bwd_s_per_sample + extra_per_sample) * r + bwd_over for r in rows)
    return fwd, bwd


def _send_s(edge: P2PEdge, src: StagePlan, ends: tuple[Device, Device], link: Link, rows: int) -> float:
    """One transfer of a micro-batch of `rows` over the edge's link (either way), with its activation
    compressor's wire bytes and kernels on the slower of its two devices."""
    nbytes = edge.bytes_per_sample * rows
    if edge.compressor == "none":
        return link.transfer_s(nbytes)
    bandwidth = min(kernel_bandwidth_bytes_s(d.type) for d in ends)
    launch = max(compute.op_overhead_s(d.type) for d in ends)
    # plans from before edges recorded their block size ran the default
    block_elems = edge.block_elems or INT8_BLOCK_ELEMS
    cost = activation_cost(edge.compressor, nbytes, C.BYTES_PER_ELEMENT[src.precision], link, bandwidth, launch,
                           block_elems)
    return cost.time_s / 2


def optimizer_step_s(param_bytes: float, device: Device) -> float:
    """AdamW step over `param_bytes` of fp32 weights: streamed through memory, as costmodel.tables does."""
    dev = device.type
    return (param_bytes * C.OPTIMIZER_BYTES_FACTOR
            / (dev.memory_bandwidth_bytes_s * C.MEMORY_EFFICIENCY) * dev.slowdown)


def _replica_work(plan: Plan, spec: ClusterSpec, devices: list[Device], replica: ReplicaPlan,
                  edges: dict[tuple[int, int], P2PEdge], lane: int = 0) -> ReplicaWork:
    """One replica's pipeline; with tensor parallelism, one lane of it (the ranks of shard `lane`, which run
    the replica's rows in step with the other lanes: a stage's times include its collectives)."""
    rows = replica.micro_batch_sizes
    stages = []
    S = len(replica.stages)
    zero = {r: len(g.ranks) for g in plan.grad_groups if g.zero for r in g.ranks}
    for s, st in enumerate(replica.stages):
        fwd, bwd = _compute_times(st, rows)
        send_fwd: tuple[float, ...] = ()
        send_bwd: tuple[float, ...] = ()
        if s + 1 < S:
            ends = (devices[st.device], devices[replica.stages[s + 1].device])
            link = spec.link_between(*ends)
            send_fwd = tuple(_send_s(edges[(replica.index, s)], st, ends, link, r) for r in rows)
        if s > 0:
            prev = replica.stages[s - 1]
            ends = (devices[st.device], devices[prev.device])
            link = spec.link_between(*ends)
            send_bwd = tuple(_send_s(edges[(replica.index, s - 1)], prev, ends, link, r) for r in rows)
        param_bytes = st.shard_param_bytes or sum(plan.blocks[b].param_bytes
                                                  for b in range(st.first_block, st.last_block + 1))
        rank = st.ranks[lane]
        step_s = optimizer_step_s(param_bytes / zero.get(rank, 1), devices[st.device])
        if rank in zero:       # ZeRO-1: each rank steps its part, then the parts are gathered (costmodel.sharded_state)
            step_s += (allgather_s(param_bytes, zero[rank], spec.inter_node.bandwidth_bytes_s, 0.0)
                       + len(st.params) * spec.inter_node.latency_s)       # a broadcast per tensor
        wgrad = tuple(st.wgrad_s_per_sample * r for r in rows)       # 0 but under zbh1
        stages.append(StageWork(rank, fwd, bwd, send_fwd, send_bwd, step_s, wgrad))
    return ReplicaWork(replica.index, replica.schedule, tuple(stages), replica.chunks)


def _sync_work(spec: ClusterSpec, group: GradGroup, rank_device: dict[int, Device]) -> SyncWork:
    if group.compressor != "none":
        # the planner that chose a compressor costed its collective; v1 takes that figure as is
        return SyncWork(group.index, group.ranks, group.estimated_s)
    link = slowest_link(spec, [rank_device[r] for r in group.ranks])
    return SyncWork(group.index, group.ranks, ring_allreduce_s(group.nbytes, len(group.ranks), link))


def from_plan(plan: Plan, spec: ClusterSpec) -> SimInput:
    """Simulator input for `plan` on the cluster `spec` it was planned for."""
    devices = spec.devices()
    rank_device: dict[int, Device] = {}
    for replica in plan.replicas:
        for st in replica.stages:
            if st.device >= len(devices):
                raise PlanningError(f"plan places rank {st.rank} on device {st.device}, the cluster has "
                                    f"{len(devices)}", file=spec.source_path, fix="simulate on the plan's cluster")
            rank_device.update((rank, devices[d]) for rank, d, _ in st.rank_devices())
    edges = {(e.replica, e.src_stage): e for e in plan.p2p}
    replicas = tuple(_replica_work(plan, spec, devices, r, edges, lane) for r in plan.replicas
                     for lane in range(r.tp_degree))
    syncs = tuple(_sync_work(spec, g, rank_device) for g in sorted(plan.grad_groups, key=lambda g: g.index))
    return SimInput(plan.world_size, plan.global_batch, replicas, syncs)
