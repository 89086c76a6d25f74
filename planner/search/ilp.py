"""The top-level CP-SAT model: which pipeline shapes, how many replicas of each, batch shares,
micro-batch counts, under device counts, minimising the estimated iteration time. This module builds
and solves it; the candidates come from planner.search.configs, the solver's settings from
planner.search.solver.

A configuration k = (device class c, stage count S, micro-batch size m) carries its best stage
split (planner.search.split). The model chooses n_k replicas of k with b_k samples each:

    sum_k n_k * b_k >= B                       (every sample of the global batch is served)
    sum_{k in c} n_k * S_k <= devices(c)       (device counts)
    M_k * m_k >= b_k                           (micro-batches per replica)
    T_pipe >= pipe_k(M_k) + opt_k              (the 1F1B schedule's makespan, planner.search.pipeline)
    T_sync >= allreduce_k(R), R = sum_k n_k    (gradient synchronisation across replicas)
    minimise T_pipe + T_sync

In the model itself, each configuration's micro-batch counts M are enumerated as items with a
fixed time and capacity (only the Pareto frontier per pipeline shape), replicas of an item are an
integer, and T_pipe is a staircase over the items' times: all linear. Two regimes are solved:
replicas spread over nodes (sync on the network) and all replicas in one node (sync on the
intra-node link); the better one wins.

Each regime without a cutoff is solved twice, small then large (`solve_bounded`): first on a coarser
frontier of its items (capacities 1/COARSE_STEP_FRACTION apart, a fraction of them), whose plan is one
of the full model's and so an upper bound U on its optimum; then, starting from that plan (a hint), on
the full frontier less every item slower than U, which no plan faster than U can use (T_pipe is at
least each used item's time). The optimum is the full model's, at a fraction of its solve (at 1024 GPUs
over half the items are slower than the coarse plan). Under a cutoff (the best time of another variant)
the items slower than it are dropped alike. "Slower" counts the least sync the item's group can be charged
at any replica count the model allows (`ItemSyncs.least_ns`: with ZeRO's group of 8 replicas, never nothing):
a plan using the item takes at least both. At 1024 GPUs the winning variant's full solve holds fewer items
and took 0.7 s instead of 1.0 s; on GPT 1.5B at 32 GPUs 1.1 s instead of 1.5 s. Without a cutoff, the best
plan that repeats one item (`single_shape_ns`, a plan of the model) is one for both solves: the coarse solve
at 1024 GPUs 0.5 -> 0.2 s; at 32 GPUs the items it leaves make the coarse step needless, and one solve
under it takes 2.3 s instead of the two steps' 3.1 s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ortools.sat.python import cp_model

from costmodel.tables import CostTables
from planner.core.cluster import Link
from planner.core.units import NS_PER_S
from planner.search import align, interleave, pipeline, zero_bubble
from planner.search.candidates import Choice, Config, Solution, shape_chunks, to_ns
from planner.search.configs import overlap_of
from planner.search.solver import DEFAULT_SETTINGS, SolverSettings, solve_model
from planner.search.sync import split_sync_s

# Replica capacities closer than 1/64 apart are one choice (bounds the model's size at large batches;
# costs at most ~1.6% of a replica's time, and none below 64 samples).
CAPACITY_STEP_FRACTION = 64
# The coarse frontier that bounds the full one (`solve_bounded`); used where it has at most half the items.
COARSE_STEP_FRACTION = 8


@dataclass(frozen=True)
class Item:
    """One way to run a replica: configuration k with M micro-batches (serves up to M*m samples)."""

    config: int
    micro_batches: int
    time_ns: int
    capacity: int


def pareto_items(tables: CostTables, configs: list[Config], max_micro: int = 256,
                 step_fraction: int = CAPACITY_STEP_FRACTION) -> list[Item]:
    """Per (replica shape, split): the (time, samples) frontier over micro-batch size and count, in
    capacity steps of at least 1/`step_fraction`.

    A replica shape that is slower and serves no more samples than another one on the same
    devices with the same cuts is never better, so only the frontier enters the model (cuts are
    kept apart: which splits combine is constrained, planner.search.align).
    """
    B = tables.global_batch
    pipeline.prime([(c.split.fwd_s, c.split.bwd_s, c.split.send_s) for c in configs if c.schedule == "1f1b"],
                   max_micro)      # every 1F1B table at once, then read count by count
    zero_bubble.prime([(c.split.fwd_s, c.split.bwd_s, c.stage_wgrad_s, c.split.send_s)
                       for c in configs if c.schedule == "zbh1"], max_micro)
    for chunks in sorted({c.chunks for c in configs if c.schedule == "interleaved"}):
        group = [c for c in configs if c.schedule == "interleaved" and c.chunks == chunks]
        interleave.prime([(c.split.fwd_s, c.split.bwd_s, c.split.send_s) for c in group], chunks,
                         {M for c in group for M in c.micro_batch_counts(B, max_micro)})
    every = [Item(k, M, c.replica_time_ns(M), min(M * c.micro_batch, B))
             for k, c in enumerate(configs) for M in c.micro_batch_counts(B, max_micro)]
    return frontier(every, configs, step_fraction)


def frontier(items: list[Item], configs: list[Config], step_fraction: int) -> list[Item]:
    """The items on each (replica shape, split)'s (time, samples) frontier, capacities at least
    1/`step_fraction` apart above `step_fraction` samples (the excess is trimmed later), and always the
    largest capacity (one replica may have to serve the whole batch). Of a frontier, a coarser one."""
    by_shape: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Item]] = {}
    for item in items:
        c = configs[item.config]
        by_shape.setdefault((c.shape, c.split.bounds), []).append(item)
    out: list[Item] = []
    for key in sorted(by_shape):
        best = 0
        ordered = sorted(by_shape[key], key=lambda i: (i.time_ns, -i.capacity, i.config))
        most = max(i.capacity for i in ordered)
        for item in ordered:
            if item.capacity > best + best // step_fraction or (item.capacity == most > best):
                best = item.capacity
                out.append(item)
    return out


SyncKey = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[str, ...], ...]]


def sync_key(config: Config) -> SyncKey:
    """What a configuration's sync time depends on: its shape, its split and the gradient compressors
    its stages have the memory for (() where not restricted)."""
    return config.shape, config.split.bounds, config.stage_compressors or ()


def sync_groups(configs: list[Config], items: list[Item]) -> tuple[list[SyncKey], list[int]]:
    """The items' sync groups (sync_key), in the model's order, and each item's group."""
    keys = [sync_key(configs[it.config]) for it in items]
    groups = sorted(set(keys), key=lambda g: (len(g[1]), g))
    index = {g: gi for gi, g in enumerate(groups)}
    return groups, [index[k] for k in keys]


def group_syncs_ns(tables: CostTables, configs: list[Config], groups: list[SyncKey], one_node: bool,
                   grid: list[int]) -> list[list[int]]:
    """Per sync group, its sync time at each level of the replica grid as the model charges it: on the
    network, or with `one_node` on the node's link (planner.search.sync)."""
    inter = Link("inter", tables.inter_bandwidth_bytes_s, tables.inter_latency_s)
    out = []
    for shape, bounds, room in groups:
        table = tables.classes[shape[0]]
        link = table.intra_link if one_node else inter
        overlap = overlap_of(tables, configs, shape, bounds)
        out.append([to_ns(t) for t in split_sync_s(tables, shape[0], bounds, grid, link, overlap, room or None,
                                                    shape_chunks(shape))])
    return out


def tables_grid(tables: CostTables) -> list[int]:
    """The replica grid the model charges sync on: up to a replica on every device (unit) of the tables."""
    return replica_grid(sum(t.num_devices for t in tables.classes))


@dataclass(frozen=True)
class ItemSyncs:
    """Items' sync groups in one regime, and each group's sync at each level of the replica grid, as the
    model charges it (made once for the bounds that read it: `least_ns`, `single_shape_ns`, bounds)."""

    grid: list[int]
    group_of: list[int]          # per item, its group
    at_ns: list[list[int]]       # per group, per level of `grid`

    @staticmethod
    def of(tables: CostTables, configs: list[Config], items: list[Item], one_node: bool) -> ItemSyncs:
        grid = tables_grid(tables)
        groups, group_of = sync_groups(configs, items)
        return ItemSyncs(grid, group_of, group_syncs_ns(tables, configs, groups, one_node, grid))

    def least_ns(self, min_replicas: int) -> list[int]:
        """Per item, the least sync its group is charged at any replica count the model allows (at least
        `min_replicas`): a plan using the item takes at least its time plus that."""
        levels = [l for l, g in enumerate(self.grid) if g >= min_replicas]
        least = [min((at[l] for l in levels), default=0) for at in self.at_ns]
        return [least[g] for g in self.group_of]


def single_shape_ns(tables: CostTables, configs: list[Config], items: list[Item], syncs: ItemSyncs,
                    one_node: bool, min_replicas: int) -> int | None:
    """The objective of the best plan that repeats one item (the replicas that serve the batch, at least
    `min_replicas`, where the devices hold them; in one node of one class with `one_node`), as the model
    charges it (its time and its group's sync at that count, `syncs` of that regime): a plan of the model,
    so an upper bound on its optimum (None: no such plan)."""
    B, grid = tables.global_batch, syncs.grid
    room = {ci: (min(t.per_node, t.num_devices) if one_node else t.num_devices) for ci, t in enumerate(tables.classes)}
    best = None
    for item, g in zip(items, syncs.group_of):
        c = configs[item.config]
        replicas = max(min_replicas, -(-B // item.capacity))
        if (one_node and c.stage_classes) or replicas > grid[-1] or \
                any(replicas * c.devices_of(ci) > room[ci] for ci in set(c.classes)):
            continue
        level = next(l for l, top in enumerate(grid) if top >= replicas)
        time_ns = item.time_ns + syncs.at_ns[g][level]
        best = time_ns if best is None else min(best, time_ns)
    return best


def replica_grid(max_replicas: int) -> list[int]:
    """1..16 exactly, then steps of about 6% (a sync estimate is off by at most that between points)."""
    grid = list(range(1, min(16, max_replicas) + 1))
    while grid[-1] < max_replicas:
        grid.append(min(max_replicas, max(grid[-1] + 1, round(grid[-1] * 1.06))))
    return grid


def solve_regime(tables: CostTables, configs: list[Config], items: list[Item], one_node: bool,
                 settings: SolverSettings, use_all_devices: bool = False,
                 max_time_ns: int | None = None, min_replicas: int = 1,
                 cutoff_ns: int | None = None, hint: Solution | None = None) -> Solution | None:
    """Minimise pipeline time + gradient sync; `one_node` keeps all replicas inside one node.
    With `max_time_ns`: minimise the price per hour of the devices used, the time at most that.
    At least `min_replicas` replicas (a ZeRO variant's group, costmodel.sharded_state). With `cutoff_ns`
    (the best time another variant reached, planner.search.degrees) only plans at most that fast are sought:
    a variant that cannot beat it is proven so, usually by the LP bound, instead of solved to its optimum."""
    B = tables.global_batch
    model = cp_model.CpModel()
    max_replicas = sum(t.num_devices for t in tables.classes)
    n, n_max = [], []
    for i, item in enumerate(items):
        c = configs[item.config]
        fits = min(tables.classes[ci].num_devices // c.devices_of(ci) for ci in set(c.classes))
        n_max.append(0 if one_node and c.stage_classes else fits)    # mixed pipelines span nodes
        n.append(model.new_int_var(0, n_max[i], f"n{i}"))
    model.add(sum(n[i] * item.capacity for i, item in enumerate(items)) >= B)
    for ci, table in enumerate(tables.classes):
        devices_used = sum(n[i] * configs[item.config].devices_of(ci) for i, item in enumerate(items)
                           if ci in configs[item.config].classes)
        if use_all_devices:
            model.add(devices_used == table.num_devices)
        else:
            model.add(devices_used <= table.num_devices)

    # Pipeline time as a staircase: ge[l] <=> T_pipe >= levels[l]; an item may be used only if
    # its time is within T_pipe.
    levels = sorted({item.time_ns for item in items})
    ge = [model.new_bool_var(f"ge{l}") for l in range(len(levels))]
    for l in range(len(levels) - 1):
        model.add_implication(ge[l + 1], ge[l])
    level_of = {t: l for l, t in enumerate(levels)}
    for i, item in enumerate(items):
        model.add(n[i] <= n_max[i] * ge[level_of[item.time_ns]])
    t_pipe = sum(ge[l] * (levels[l] - (levels[l - 1] if l else 0)) for l in range(len(levels)))

    if min_replicas > max_replicas:
        return None
    replicas = model.new_int_var(min_replicas, max_replicas, "replicas")
    model.add(replicas == sum(n))
    # Replica count as a staircase too: above[l] <=> R > grid[l]; sync time is charged at the next
    # grid point (exact on the grid, an upper bound between points). Cheaper than an element
    # constraint over every count, which presolve expands value by value.
    grid = replica_grid(max_replicas)
    above = [model.new_bool_var(f"above{g}") for g in grid[:-1]]
    for l, g in enumerate(grid[:-1]):
        model.add(replicas <= g).only_enforce_if(above[l].Not())
        model.add(replicas >= g + 1).only_enforce_if(above[l])
    t_sync = model.new_int_var(0, 1 << 50, "t_sync_ns")
    # splits used together must have nested cuts (aligned gradient groups, planner.search.align)
    splits = sorted({configs[it.config].split.bounds for it in items}, key=lambda b: (len(b), b))
    split_used = []
    for si, bounds in enumerate(splits):
        flag = model.new_bool_var(f"split{si}")
        for i, it in enumerate(items):
            if configs[it.config].split.bounds == bounds:
                model.add(n[i] <= n_max[i] * flag)
        split_used.append(flag)
    for S in sorted({len(b) for b in splits}):
        model.add_at_most_one(split_used[si] for si, b in enumerate(splits) if len(b) == S)
    for a, b in align.conflicts(splits):
        if len(splits[a]) != len(splits[b]):
            model.add_bool_or([split_used[a].Not(), split_used[b].Not()])
    # one sync term per (shape, split, compressors its stages have the memory for): configurations
    # whose stages fit different compressors are charged their own sync (planner.search.compressors)
    groups, group_of = sync_groups(configs, items)
    class_used: dict[int, list[cp_model.IntVar]] = {ci: [] for ci in range(len(tables.classes))}
    for gi, ((shape, _, _), at) in enumerate(zip(groups, group_syncs_ns(tables, configs, groups, one_node, grid))):
        ci = shape[0]
        group_used = model.new_bool_var(f"group{gi}")
        for i in (i for i, g in enumerate(group_of) if g == gi):
            model.add(n[i] <= n_max[i] * group_used)
        class_used[ci].append(group_used)
        # at[0]: one replica's sync, nonzero where a tied parameter joins stages of one pipeline
        model.add(t_sync >= at[0] + sum(above[l] * (at[l + 1] - at[l]) for l in range(len(grid) - 1))
                  ).only_enforce_if(group_used)
    if one_node:
        for ci, table in enumerate(tables.classes):   # all replicas of the class fit in one node
            model.add(sum(n[i] * configs[it.config].devices_of(ci) for i, it in enumerate(items)
                          if ci in configs[it.config].classes) <= table.per_node)
        any_used = []
        for ci, flags in class_used.items():
            if flags:
                flag = model.new_bool_var(f"class{ci}")
                model.add_max_equality(flag, flags)
                any_used.append(flag)
        model.add(sum(any_used) <= 1)
    if cutoff_ns is not None:
        model.add(t_pipe + t_sync <= cutoff_ns)
    if max_time_ns is None:
        model.minimize(t_pipe + t_sync)
    else:   # cents per hour, integral; planner.search.cost checks every class has a price
        model.add(t_pipe + t_sync <= max_time_ns)
        model.minimize(sum(n[i] * sum(round(100 * (tables.classes[ci].price_per_hour or 0.0))
                                      for ci in configs[it.config].classes) for i, it in enumerate(items)))

    if hint is not None:     # a plan of these items to start from (solve_bounded: the coarse one)
        chosen = {(id(c.config), c.share): c.replicas for c in hint.choices}
        for i, item in enumerate(items):
            model.add_hint(n[i], chosen.get((id(configs[item.config]), item.capacity), 0))
    name = ("one-node" if one_node else "spread") + ("" if max_time_ns is None else f"-within-{max_time_ns}ns")
    solver, status = solve_model(model, settings, name)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choices = tuple(Choice(configs[item.config], solver.value(n[i]), item.capacity)
                    for i, item in enumerate(items) if solver.value(n[i]))
    time_ns = solver.value(t_pipe) + solver.value(t_sync)
    return Solution(choices=choices, pipeline_s=solver.value(t_pipe) / NS_PER_S,
                    sync_s=solver.value(t_sync) / NS_PER_S,
                    objective_s=(solver.objective_value if max_time_ns is None else time_ns) / NS_PER_S,
                    bound_s=(solver.best_objective_bound if max_time_ns is None else time_ns) / NS_PER_S,
                    status=solver.status_name(status), configurations=len(items), one_node=one_node)


def regimes(tables: CostTables, use_all_devices: bool) -> list[bool]:
    """The topology regimes a plan may take (`one_node`: False, replicas spread over the network; True, all
    in one node). A plan that uses every device is in one node only where every device is in one node of one
    class; there its gradient sync runs on the node's link, not the network's."""
    if not use_all_devices:
        return [False, True]
    used = [t for t in tables.classes if t.num_devices]
    return [False, True] if len(used) == 1 and used[0].num_devices <= used[0].per_node else [False]


def solve(tables: CostTables, configs: list[Config], settings: SolverSettings = DEFAULT_SETTINGS,
          use_all_devices: bool = False) -> Solution | None:
    """Best plan over two topology regimes: replicas spread over the network, or inside one node."""
    found = solve_regimes(tables, configs, settings, use_all_devices)
    return found[0] if found else None


def solve_regimes(tables: CostTables, configs: list[Config], settings: SolverSettings = DEFAULT_SETTINGS,
                  use_all_devices: bool = False, min_replicas: int = 1,
                  cutoff_s: float | None = None, items: list[Item] | None = None) -> list[Solution]:
    """The best plan of each topology regime that has one, best first (`items`: pareto_items of these
    configurations where the caller built them)."""
    items = pareto_items(tables, configs) if items is None else items
    if not items:
        return []
    cutoff_ns = None if cutoff_s is None or cutoff_s == float("inf") else to_ns(cutoff_s)
    found = [s for s in (solve_bounded(tables, configs, items, one, settings, use_all_devices,
                                       min_replicas=min_replicas, cutoff_ns=cutoff_ns)
                         for one in regimes(tables, use_all_devices)) if s is not None]
    return sorted(found, key=lambda s: (s.objective_s, s.one_node))


def solve_bounded(tables: CostTables, configs: list[Config], items: list[Item], one_node: bool,
                  settings: SolverSettings, use_all_devices: bool = False, min_replicas: int = 1,
                  cutoff_ns: int | None = None) -> Solution | None:
    """`solve_regime` on `items`, bounded first by the plan of the coarse frontier (module docstring):
    the same optimum, the model solved at the end holding only the items that could be in it."""
    syncs = ItemSyncs.of(tables, configs, items, one_node)
    least_sync = syncs.least_ns(min_replicas)
    # without a cutoff, the best plan of one shape repeated is one (single_shape_ns): it bounds both solves
    alone = None if cutoff_ns is not None or use_all_devices else \
        single_shape_ns(tables, configs, items, syncs, one_node, min_replicas)
    limit_ns = cutoff_ns if cutoff_ns is not None else alone
    kept = [i for i, sync in zip(items, least_sync) if limit_ns is None or i.time_ns + sync <= limit_ns]
    # under a cutoff (another variant's best) the items are bounded by it already, and a variant that
    # cannot beat it would be proved so twice; a coarse frontier not under half the items saves nothing
    first = None
    within_limit = {id(i) for i in kept}
    coarse = [] if cutoff_ns is not None else \
        [i for i in frontier(items, configs, COARSE_STEP_FRACTION) if id(i) in within_limit]  # its plan: theirs
    if cutoff_ns is None and 2 * len(coarse) <= len(kept):
        first = solve_regime(tables, configs, coarse, one_node, settings, use_all_devices,
                             min_replicas=min_replicas, cutoff_ns=limit_ns)
    if first is None:
        found = solve_regime(tables, configs, kept, one_node, settings, use_all_devices,
                             min_replicas=min_replicas, cutoff_ns=limit_ns)
    else:
        bound_ns = to_ns(first.objective_s)
        within = [i for i, sync in zip(items, least_sync) if i.time_ns + sync <= bound_ns]
        found = solve_regime(tables, configs, within, one_node, settings,
                             use_all_devices, min_replicas=min_replicas, cutoff_ns=bound_ns, hint=first)
        found = found if found is not None and found.objective_s <= first.objective_s else first
    # the model's size as the search offered it (the items before any bound)
    return None if found is None else dataclasses.replace(found, configurations=len(items))
