"""Turn the solver's numbers into a Plan: devices and ranks, trimmed shares, micro-batches,
stage records, point-to-point edges, gradient groups and estimates.

Assembly places and records; it decides nothing that changes time or memory. Each edge gets the
activation compressor its cut's transfer was priced with in the split (Split.send_compressors);
each gradient group the compressor the search's sync charges for it: the best the policy allows
among those whose state every member's stage has the memory for (Config.stage_compressors,
planner.search.compressors), with the runtime settings it was priced with. Each rank's memory is
its stage's need by the one memory rule (costmodel.memory), compressor state included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from costmodel import compression, compute, memory, sharded_state
from costmodel.tables import CostTables, output_bytes
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec, Device
from planner.core.errors import PlanningError
from planner.core.ir import (
    BlockInfo,
    Estimates,
    GradGroup,
    P2PEdge,
    Plan,
    PlanInputs,
    ReplicaPlan,
    SolverFacts,
    StagePlan,
)
from planner.search.candidates import Choice, Config, Solution
from planner.search.compressors import group_allowed, stage_allowed
from planner.search.schedules import stage_need_bytes
from planner.search.split import block_phases_s


@dataclass
class _Replica:
    config: Config
    share: int
    devices: list[Device]

    def time_s(self, share: int | None = None) -> float:
        share = self.share if share is None else share
        return self.config.replica_time_s(len(self.config.micro_batch_sizes(share)))

    def estimated_s(self, tables: CostTables) -> float:
        """The replica's iteration as the program runs it: a share below the micro-batch size is one
        micro-batch of that many rows, priced at its rows (the search's items price whole micro-batches:
        with the size forced, a replica of 1 sample was charged a micro-batch of 16, 1.5x its time on an
        overhead-bound model); the sends stay priced at the whole micro-batch's, an upper bound."""
        if self.share >= self.config.micro_batch:
            return self.time_s()
        return at_rows(self.config, tables, self.share).replica_time_s(1)


def at_rows(config: Config, tables: CostTables, rows: int) -> Config:
    """`config` with each stage's forward and backward for micro-batches of `rows` rows (its recompute
    flags and its sends as they are)."""
    split = config.split
    phases = [block_phases_s(tables.classes[ci], range(split.bounds[s], split.bounds[s + 1]), rows,
                             split.stage_recompute[s]) for s, ci in enumerate(config.classes)]
    return dataclasses.replace(config, split=dataclasses.replace(
        split, fwd_s=tuple(f for f, _ in phases), bwd_s=tuple(b for _, b in phases)))


def _take(free: dict[int, list[Device]], count: int, per_node: int) -> list[Device]:
    """`count` devices of one class: inside one node when they fit in one, else whole nodes."""
    if count <= per_node:
        node = next((n for n, ds in free.items() if len(ds) >= count), None)
        if node is None:
            node = max(free, key=lambda n: len(free[n]))
        taken = free[node][:count]
        free[node] = free[node][count:]
        if len(taken) < count:  # packing spilled over: take the rest from other nodes
            for n in sorted(free):
                while len(taken) < count and free[n]:
                    taken.append(free[n].pop(0))
        return taken
    taken = []
    for n in sorted(free):
        if len(taken) < count and len(free[n]) == per_node:
            taken.extend(free[n])
            free[n] = []
    return taken[:count]


def _take_shards(free: dict[int, list[Device]], stages: int, degree: int) -> list[Device]:
    """Devices for `stages` stages of `degree` tensor-parallel shards each, every stage's inside one node:
    the node of the stage before while it has room, else the node with the most free devices (nodes hold
    a multiple of `degree`, and every take is one, so a node with room for a stage exists while any has)."""
    taken: list[Device] = []
    node: int | None = None
    for _ in range(stages):
        if node is None or len(free[node]) < degree:
            node = max(sorted(free), key=lambda n: len(free[n]))
        if len(free[node]) < degree:
            break
        taken += free[node][:degree]
        free[node] = free[node][degree:]
    return taken


def _class_of_node(spec: ClusterSpec, tables: CostTables) -> dict[int, int]:
    """The device class (costmodel.tables: one per node group, in spec order) of each node. A cluster
    less lost devices has several node groups of one name (planner.core.cluster), told apart by node."""
    if len(spec.nodes) != len(tables.classes):
        raise PlanningError(f"the cost tables have {len(tables.classes)} device classes for {len(spec.nodes)} "
                            "node groups", file=spec.source_path, fix="cost the cluster the plan is assembled on")
    first = {d.node: d for d in spec.devices()}
    out: dict[int, int] = {}
    for ci, group in enumerate(spec.nodes):
        nodes = group.nodes or tuple(n for n, d in first.items() if d.group == group.name)
        out.update((n, ci) for n in nodes)
    return out


def _allocate(spec: ClusterSpec, tables: CostTables, choices: tuple[Choice, ...]) -> list[_Replica]:
    """Give each replica devices: pipelines across classes first (each portion inside one node when
    it fits in one, else whole nodes), then each class's pipelines, deepest first."""
    free: list[dict[int, list[Device]]] = [{} for _ in tables.classes]
    class_of_node = _class_of_node(spec, tables)
    for d in spec.devices():
        free[class_of_node[d.node]].setdefault(d.node, []).append(d)
    order = sorted(choices, key=lambda c: (not c.config.stage_classes, c.config.cls, -c.config.num_stages))
    replicas: list[_Replica] = []
    for choice in order:
        portions = list(dict.fromkeys(choice.config.classes))
        for _ in range(choice.replicas):
            taken: list[Device] = []
            for ci in portions:
                table = tables.classes[ci]
                if table.tp_degree > 1:
                    taken += _take_shards(free[ci], choice.config.devices_of(ci), table.tp_degree)
                else:
                    taken += _take(free[ci], choice.config.devices_of(ci), table.per_node)
            replicas.append(_Replica(choice.config, choice.share, taken))
    return replicas


def _trim(replicas: list[_Replica], global_batch: int) -> None:
    """The solver may serve a few samples more than B; take them from the slowest replicas (of those whose
    schedule runs one sample less: interleaved 1F1B needs micro-batch counts of whole rounds)."""
    excess = sum(r.share for r in replicas) - global_batch
    while excess > 0:
        candidates = [r for r in replicas if r.share > 1 and r.config.micro_batch_sizes(r.share - 1)]
        slowest = max(candidates, key=lambda r: (r.time_s(), r.share))
        slowest.share -= 1
        excess -= 1


def _priced_parts(tables: CostTables, cfg: Config, s: int, need_bytes: float) -> tuple[float, float, float]:
    """Of stage `s`'s priced need (its device's, before compressor state): the training state of its
    device's stages (one, or under interleaved 1F1B each chunk's), the optimizer state's part of it, and the
    activations (what remains after the framework's share; costmodel.memory.need_bytes)."""
    devices = len(cfg.device_classes)
    table = tables.classes[cfg.classes[s]]
    bounds = cfg.split.bounds
    state = table.held_state_bytes(range(bounds[k], bounds[k + 1]) for k in range(s % devices, cfg.num_stages, devices))
    optimizer = sharded_state.optimizer_part_bytes(state, table.precision, table.zero_group)
    return state, optimizer, need_bytes - state - table.framework_bytes


def assemble(*, solution: Solution, tables: CostTables, blocks: list[Block], spec: ClusterSpec,
             inputs: PlanInputs, strategy: str) -> Plan:
    replicas = _allocate(spec, tables, solution.choices)
    degree = max(c.tp_degree for c in tables.classes)
    zero = max(c.zero_group for c in tables.classes) > 1       # costmodel.sharded_state priced every group so
    shardings = tables.shardings
    sharded = {p for sh in shardings if sh.divides(degree) for p in sh.sharded_params} if degree > 1 else set()
    if any(len(r.devices) < len(r.config.device_classes) * degree for r in replicas):
        raise PlanningError("could not place the chosen pipelines on the nodes",
                            file=spec.source_path, fix="report this with the cluster spec")
    _trim(replicas, tables.global_batch)
    replicas.sort(key=lambda r: r.devices[0].index)
    param_bytes = {p: size / (degree if p in sharded else 1)
                   for b in blocks for p, size in zip(b.params, b.param_sizes)}

    rank = 0
    replica_plans: list[ReplicaPlan] = []
    holders: dict[tuple[str, int], list[int]] = {}   # (parameter, shard lane) -> ranks
    p2p: list[P2PEdge] = []
    memory_by_rank: list[float] = []
    capacity_by_rank: list[float] = []
    busy_by_rank: list[float] = []
    device_labels: list[str] = []
    stage_of_rank: list[tuple[Config, int]] = []
    for ri, rep in enumerate(replicas):
        cfg = rep.config
        S, D = cfg.num_stages, len(cfg.device_classes)     # stages, and devices (fewer under interleaving)
        micro_sizes = cfg.micro_batch_sizes(rep.share)
        stages = []
        busy_by_device = [0.0] * D
        for s in range(S):
            d = s % D
            lo, hi = cfg.split.bounds[s], cfg.split.bounds[s + 1]
            params: list[str] = []
            for b in range(lo, hi):
                params.extend(p for p in blocks[b].params if p not in params)
            ranks = tuple(range(rank + d * degree, rank + (d + 1) * degree))
            for lane, r in enumerate(ranks):
                for p in params:
                    holders.setdefault((p, lane), []).append(r)
            table = tables.classes[cfg.classes[s]]
            recompute = cfg.split.stage_recompute[s]
            fwd = sum(table.fwd_s[b] for b in range(lo, hi)) * (2 if recompute else 1)
            bwd = sum(table.bwd_s[b] for b in range(lo, hi))
            over = sum(table.overhead_s[b] for b in range(lo, hi))
            if cfg.schedule == "interleaved":       # the device's need, its stages' together (interleave_configs)
                mem = cfg.split.stage_memory_bytes[s]
            else:
                in_flight = memory.in_flight_micro_batches(cfg.schedule, s, S, len(micro_sizes))
                mem = stage_need_bytes(table, range(lo, hi), cfg.micro_batch, in_flight, recompute)
            devs = rep.devices[d * degree:(d + 1) * degree]
            dev = devs[0]
            sharded_stage = degree > 1
            state, optimizer, activations = _priced_parts(tables, cfg, s, mem)
            stages.append(StagePlan(
                index=s, first_block=lo, last_block=hi - 1, last_node=blocks[hi - 1].last_node,
                rank=ranks[0], device=dev.index, device_label=dev.label, device_type=dev.type.name,
                precision=table.precision, recompute=recompute, fwd_s_per_sample=fwd, bwd_s_per_sample=bwd,
                overhead_s=over, memory_bytes=mem, params=tuple(params),
                slowdown=dev.type.slowdown, tp_ranks=ranks if sharded_stage else (),
                tp_devices=tuple(d.index for d in devs) if sharded_stage else (),
                tp_device_labels=tuple(d.label for d in devs) if sharded_stage else (),
                shard_param_bytes=sum(param_bytes[p] for p in params),
                state_bytes=state, optimizer_bytes=optimizer, activation_bytes=activations,
                wgrad_s_per_sample=cfg.stage_wgrad_s[s] / cfg.micro_batch if cfg.stage_wgrad_s else 0.0))
            busy_by_device[d] += (fwd + bwd) * rep.share + over * len(micro_sizes)
            if s > 0:
                previous = stages[s - 1].ranks
                sender = tables.classes[cfg.classes[s - 1]]
                codec = cfg.split.send_compressors[s - 1] if cfg.split.send_compressors else "none"
                for lane in range(degree):
                    p2p.append(P2PEdge(ri, s - 1, s, previous[lane], ranks[lane], sender.boundary_bytes[lo - 1],
                                       codec, block_elems=compression.INT8_BLOCK_ELEMS if codec == "int8" else 0))
            if s < D:                               # the device's first stage: its ranks' records
                for d_ in devs:
                    memory_by_rank.append(mem)
                    capacity_by_rank.append(float(d_.type.memory_bytes))
                    device_labels.append(d_.label)
                    stage_of_rank.append((cfg, s))
        for d in range(D):
            busy_by_rank.extend([busy_by_device[d]] * degree)
        rank += D * degree
        group = "+".join(dict.fromkeys(tables.classes[ci].name for ci in cfg.classes))
        replica_plans.append(ReplicaPlan(ri, group, tuple(stages), rep.share, micro_sizes, cfg.schedule,
                                         rep.estimated_s(tables), chunks=cfg.chunks, optimizer_s=cfg.optimizer_s))

    all_devices = spec.devices()
    rank_device = {r: all_devices[d] for rp in replica_plans for st in rp.stages for r, d, _ in st.rank_devices()}
    groups: dict[tuple[int, ...], list[str]] = {}
    for (p, _), holding in holders.items():
        if len(holding) > 1:
            groups.setdefault(tuple(sorted(holding)), []).append(p)
    policy = compression.compression_of(tables)
    grad_groups = []
    for gi, (ranks, params) in enumerate(sorted(groups.items())):
        nbytes = sum(param_bytes.get(p, 0.0) for p in params)
        nodes = {rank_device[r].node for r in ranks}
        link = spec.inter_node if len(nodes) > 1 else spec.link_between(rank_device[ranks[0]],
                                                                          rank_device[ranks[0]])
        # the compressor the policy allows that syncs fastest among those whose state every member has
        # the memory for (as the search costed it); its state (error feedback, PowerSGD P/Q) adds to
        # each member's memory
        bandwidth = min(compression.kernel_bandwidth_bytes_s(rank_device[r].type) for r in ranks)
        launch = max(compute.op_overhead_s(rank_device[r].type) for r in ranks)
        allowed = group_allowed(stage_allowed(*stage_of_rank[r]) for r in ranks)
        if degree > 1:    # a compressor's state is priced on whole parameters; shards sync exactly
            allowed = frozenset({"none"})
        if zero:          # 1-bit Adam exchanges momentum inside its own step: not with a sharded one
            allowed = (allowed if allowed is not None else frozenset(compression.GRADIENT_COMPRESSORS)) - {"onebit"}
        cost = compression.choose_gradient(policy, params, nbytes, len(ranks), link, bandwidth, launch, allowed)
        grad_groups.append(GradGroup(gi, ranks, tuple(params), nbytes, cost.name, cost.algorithm,
                                     cost.time_s, settings=compression.settings_of(cost.name), zero=zero))
        for r in ranks:
            memory_by_rank[r] += cost.state_bytes

    pipeline_s = max(r.estimated_s for r in replica_plans)
    iteration_s = pipeline_s + solution.sync_s
    world = rank
    bubble = 1.0 - sum(busy_by_rank) / (iteration_s * world) if iteration_s > 0 else 0.0
    prices = [rank_device[r].type.price_per_hour for r in range(world)]
    cost_per_sample = None
    if all(p is not None for p in prices):
        cost_per_sample = sum(p for p in prices if p is not None) / 3600.0 * iteration_s / tables.global_batch
    estimates = Estimates(
        iteration_s=iteration_s, throughput_samples_s=tables.global_batch / iteration_s,
        pipeline_s=pipeline_s, sync_s=solution.sync_s, bubble_fraction=max(bubble, 0.0),
        memory_bytes=tuple(memory_by_rank), capacity_bytes=tuple(capacity_by_rank),
        busy_s=tuple(busy_by_rank), cost_per_sample=cost_per_sample, memory_margin=tables.memory_margin)
    gap = (solution.objective_s - solution.bound_s) / solution.objective_s if solution.objective_s else 0.0
    facts = SolverFacts(strategy, solution.status, solution.objective_s, solution.bound_s, max(gap, 0.0),
                        solution.configurations)
    block_infos = tuple(BlockInfo(b.index, b.first_node, b.last_node, b.label, b.fwd_flops, b.bwd_flops,
                                  b.param_bytes, b.activation_bytes, b.boundary_bytes, b.signature,
                                  memory.backward_transient_bytes(b.largest_output_bytes),
                                  output_bytes(b) if b.index == len(blocks) - 1 else 0.0)
                        for b in blocks)
    return Plan(inputs=inputs, global_batch=tables.global_batch, world_size=world, blocks=block_infos,
                replicas=tuple(replica_plans), grad_groups=tuple(grad_groups), p2p=tuple(p2p),
                estimates=estimates, solver=facts, devices=tuple(device_labels))
