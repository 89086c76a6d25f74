"""The search over tensor-parallel degree and sharded optimizer state: one CP-SAT search per variant.

A variant is the cost tables at a tensor-parallel degree t (costmodel.tensor_parallel: a stage on t
devices of a node) with or without ZeRO-1 (costmodel.sharded_state: optimizer state over at least z
replicas). Every stage of a plan shares one degree: a gradient group sums the same shard of a parameter
in every replica, so replicas of different degrees could not sync (the program would need each
parameter cut at the finest degree). Each variant's configurations and CP-SAT models are the ones the
degree-1 search builds (planner.search.configs, planner.search.ilp), on its own tables; the best
solution over the variants wins, ties to the lower degree and no ZeRO (fewer collectives). Under the time
objective a variant whose lower bound already exceeds the best plan found is not built, or not solved
(`search`, planner.search.bounds).

ZeRO is offered where memory is short (`zero="auto"`: the model does not fit one device of any class
whole), always (`on`), or never (`off`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from costmodel import sharded_state, tensor_parallel
from costmodel.compression import compression_of
from costmodel.tables import CostTables
from planner.search import ahead, bounds, cost, ilp
from planner.search.candidates import Config, Solution
from planner.search.configs import MIXED_MAX_DEVICES, build_configs, stage_count_options
from planner.search.enumerate import exact_solution
from planner.search.options import SearchOptions
from planner.search.split import fits_greedily

ZERO_MAX_GROUP = 8       # the moments over 8 replicas: 1/8 left, most of what sharding saves
SOLVE_THREADS = 2        # variants solved at once once one is solved (CP-SAT releases the interpreter lock)


@dataclass(frozen=True)
class Variant:
    """One variant's tables and configurations."""

    tp_degree: int
    zero_group: int          # 1: no ZeRO
    tables: CostTables
    configs: list[Config]


def variants(tables: CostTables, options: SearchOptions) -> list[Variant]:
    """Every variant the options allow that has some configuration, lowest degree first."""
    out = []
    for t, z, at_tz in variant_tables(tables, options):
        configs = build_configs(at_tz, options.stages, options.micro_batch, schedule=options.schedule)
        if configs:
            out.append(Variant(t, z, at_tz, configs))
    return out


def variant_tables(tables: CostTables, options: SearchOptions) -> list[tuple[int, int, CostTables]]:
    """(degree, ZeRO group, tables) of every variant the options allow, lowest degree first; cheap (no
    configurations built)."""
    out: list[tuple[int, int, CostTables]] = []
    # gradient compression prices whole parameters and 1-bit Adam keeps its own momentum: a plan that
    # compresses its gradients gets tensor parallelism or ZeRO only where the user forces them
    compressed = compression_of(tables).compresses_gradients
    degrees = tensor_parallel.usable_degrees(tables, tables.shardings, options.tp, options.use_all_devices)
    if compressed and options.tp is None:
        degrees = [t for t in degrees if t == 1]
    zero = "off" if compressed and options.zero == "auto" else options.zero
    for t in degrees:
        at_t = tensor_parallel.at_degree(tables, tables.shardings, t)
        out.extend((t, z, sharded_state.at_group(at_t, z)) for z in _zero_groups(at_t, zero))
    return out


def compute_bound_s(tables: CostTables) -> float:
    """A lower bound on any plan's iteration time at these tables: the forward and backward work of the
    global batch spread over every device at once, each block on the class cheapest for it.

    A device of class c does a block's work at no better than rho_c times the cheapest class's time for
    it (rho_c = min over blocks of its time / the cheapest), so per second it covers at most 1/rho_c
    seconds of cheapest-class work; the batch needs B * sum_b cheapest_b of it. Every pipeline's makespan
    is at least its busiest device's work, and sync only adds: the ILP's and the enumerator's objectives
    are never below this."""
    held = [c for c in tables.classes if c.num_devices]
    if not held:
        return float("inf")
    work = [[f + b for f, b in zip(c.fwd_s, c.bwd_s)] for c in held]
    cheapest = [min(w[b] for w in work) for b in range(tables.num_blocks)]
    if min(cheapest) <= 0:
        return 0.0
    rate = sum(c.num_devices / min(w[b] / cheapest[b] for b in range(tables.num_blocks))
               for c, w in zip(held, work))
    return tables.global_batch * sum(cheapest) / rate


def _zero_groups(tables: CostTables, zero: str) -> list[int]:
    """The ZeRO group sizes to price at these tables: 1 (none) and/or the largest the cluster allows."""
    units = sum(c.num_devices for c in tables.classes)
    group = 1
    while group * 2 <= min(ZERO_MAX_GROUP, units):
        group *= 2
    if zero == "off" or group == 1:
        return [1] if zero != "on" or group == 1 else []
    if zero == "on":
        return [group]
    return [1, group] if memory_short(tables) else [1]


def memory_short(tables: CostTables) -> bool:
    """The model does not fit one device of any class whole (one stage, micro-batch 1, no recompute)."""
    return not any(c.num_devices and fits_greedily(c, 1, 1, False) for c in tables.classes)


def solve(variant: Variant, options: SearchOptions, cutoff_s: float | None = None,
          items: list[ilp.Item] | None = None) -> list[Solution]:
    """The variant's solutions under the strategy and objective, best first (as strategies.run asks); under
    the time objective with `cutoff_s`, only solutions at most that fast (ilp.solve_regime); `items`: the
    variant's ilp.pareto_items where already built."""
    least = variant.zero_group
    settings = options.solver
    if settings.dump_dir is not None and (variant.tp_degree, variant.zero_group) != (1, 1):
        # each variant's CP-SAT models in a folder of their own (`plan --dump-cp-model DIR`: DIR/tp2-zero1/)
        settings = dataclasses.replace(settings, dump_dir=settings.dump_dir / f"tp{variant.tp_degree}-zero{least}")
    if options.strategy == "exact":
        found = exact_solution(variant.tables, variant.configs, use_all_devices=options.use_all_devices,
                               min_replicas=least)
        return [found] if found else []
    if options.objective == "cost":
        return cost.solve_cost(variant.tables, variant.configs, settings,
                               use_all_devices=options.use_all_devices, min_replicas=least)
    return ilp.solve_regimes(variant.tables, variant.configs, settings,
                             use_all_devices=options.use_all_devices, min_replicas=least, cutoff_s=cutoff_s,
                             items=items)


def most_replicas(tables: CostTables, options: SearchOptions) -> float:
    """An upper bound on the replicas of any plan at these tables (inf where none is known): each class's
    devices over the fewest stages at which the model fits it (split.fits_greedily, micro-batch 1,
    recompute: what any configuration needs at the least). Only where build_configs offers single-class
    pipelines alone (mixed ones could take fewer devices of a class): more GPUs than MIXED_MAX_DEVICES
    and some class that fits."""
    if sum(c.num_devices * c.tp_degree for c in tables.classes) <= MIXED_MAX_DEVICES:
        return float("inf")
    total, any_fits = 0, False
    for c in tables.classes:
        offered = stage_count_options(tables.num_blocks, c.num_devices, c.per_node, options.stages)
        fewest = next((S for S in offered if fits_greedily(c, S, 1, True)), None)
        if fewest is not None:
            total, any_fits = total + c.num_devices // fewest, True
    return total if any_fits else float("inf")


def best(tables: CostTables, options: SearchOptions) -> list[tuple[Solution, Variant]]:
    """Every solved variant's solutions, best first (ties: lower degree, then no ZeRO); see `search`."""
    return search(tables, options)[0]


def search(tables: CostTables, options: SearchOptions,
           ) -> tuple[list[tuple[Solution, Variant]], list[dict[str, float | int | str]]]:
    """The solutions of every variant that could win, best first, and per variant what it cost to find
    them (configurations built and solved, seconds each; `pruned` where skipped).

    Under the time objective the variants are taken likeliest winner first (below), and a variant whose lower
    bound (`compute_bound_s` and bounds.pipeline_bound_s: the least time any plan of the variant could
    take) exceeds the best objective found so far is skipped before its configurations are built, or,
    by the bound over its CP-SAT items (bounds.items_bound_s, then with their gradient sync:
    `sync_bound_s`), before its model is: it could not win, so the chosen plan is the one the full search
    would choose. The others are solved with the best time so far as a cutoff (ilp.solve_regime): once one
    variant is solved, two at a time on threads (CP-SAT releases the interpreter lock), each decided with
    the best of every variant before it but the one solving beside it, so the decisions, the records and
    the plan never depend on which solve ends first. The runners-up then come from the variants solved."""
    by_time = options.objective == "time"
    interleaved = options.schedule in ("auto", "interleaved")
    zero_bubble = options.schedule == "zbh1"
    todo = [(max(compute_bound_s(at), bounds.pipeline_bound_s(at, options.stages, options.micro_batch, interleaved,
                                                             zero_bubble))
             if by_time else 0.0, t, z, at) for t, z, at in variant_tables(tables, options)]
    # The variant likeliest to win first, so that the others meet its time as a bound or a cutoff (which
    # proves them no better in a fraction of their solve); the order changes no plan, only the time to it.
    # Where memory is short, ZeRO and a middle degree win: enough devices per stage to need few stages,
    # not so many that every layer's all-reduce spans the node (Llama-2-70B: TP 4 at 1024 GPUs and on the
    # 768-device fleet, where the highest first solved TP 8 unbounded in 1.4-2.1 s, then TP 4; the middle
    # first proves TP 8 no better by its bound or a cutoff). Where the model fits a device whole, the
    # lowest degree, without TP's collectives, does (GPT 1.5B on 32 and 64 mixed GPUs: TP 4 first took
    # 4-6 s to solve)
    short = memory_short(tables)
    place = middle_out(sorted({t for _, t, _, _ in todo}))
    todo.sort(key=lambda b_t_z: (place[b_t_z[1]], -b_t_z[2]) if short else (b_t_z[1], b_t_z[2]))
    found: list[tuple[Solution, Variant]] = []
    records: list[dict[str, float | int | str]] = []
    best_s = float("inf")
    with_items = options.strategy != "exact" and by_time

    def make_configs(at: CostTables) -> list[Config]:
        return build_configs(at, options.stages, options.micro_batch, schedule=options.schedule)

    # each variant's configurations and items built on a worker while the one before it solves (ahead)
    pending: list[tuple[dict[str, float | int | str], Variant, float, Future[list[Solution]]]] = []
    with ahead.built_ahead([at for _, _, _, at in todo], make_configs, with_items, options.fork) as builds, \
            ThreadPoolExecutor(max_workers=SOLVE_THREADS, thread_name_prefix="hetplan-solve") as solves:
        for (bound_s, t, z, at), future in zip(todo, builds):
            while len(pending) >= SOLVE_THREADS:     # each decision knows every solve but the latest one's
                best_s = _taken(pending.pop(0), found, best_s)
            record: dict[str, float | int | str] = {"tp_degree": t, "zero_group": z, "bound_s": bound_s,
                                                    "configs_s": 0.0, "solve_s": 0.0, "configurations": 0}
            records.append(record)
            if by_time and _above(bound_s, best_s):
                record["pruned"] = "lower bound above the best found"
                future.cancel()
                continue
            if z > most_replicas(at, options):
                record["pruned"] = f"at most {most_replicas(at, options)} replicas fit, ZeRO's group needs {z}"
                future.cancel()
                continue
            t0 = time.perf_counter()
            built = future.result()
            record["wait_s"], t0 = time.perf_counter() - t0, time.perf_counter()
            record["configs_s"], record["items_s"] = built.configs_s, built.items_s
            record["configurations"] = len(built.configs)
            if not built.configs:
                continue
            variant = Variant(t, z, at, built.configs)
            if built.items is not None:
                record["items_bound_s"] = bounds.items_bound_s(at, built.configs, [(i.config, i.time_ns, i.capacity)
                                                                                   for i in built.items])
                if _above(float(record["items_bound_s"]), best_s):
                    record["pruned"] = "bound over the CP-SAT items above the best found"
                    record["solve_s"] = time.perf_counter() - t0
                    continue
                if best_s < float("inf"):
                    record["sync_bound_s"] = sync_bound_s(at, built.configs, built.items, options, z)
                    if _above(float(record["sync_bound_s"]), best_s):
                        record["pruned"] = "bound over the CP-SAT items with their gradient sync above the best found"
                        record["solve_s"] = time.perf_counter() - t0
                        continue
            cutoff_s = best_s if by_time else None
            if best_s == float("inf"):       # nothing found yet: solved here, its best bounds the rest
                solutions = solve(variant, options, cutoff_s, built.items)
                record["solve_s"] = time.perf_counter() - t0
                best_s = _absorb(record, variant, solutions, found, best_s)
            else:      # the rest two at once, each against the best of those before the one beside it
                pending.append((record, variant, t0, solves.submit(solve, variant, options, cutoff_s, built.items)))
        for solving in pending:
            best_s = _taken(solving, found, best_s)

    def key(sv: tuple[Solution, Variant]) -> tuple[float, float, int, int, bool]:
        s, v = sv
        price = cost.cost_per_sample(v.tables, s) if options.objective == "cost" else 0.0
        return (round(price, 15), round(s.objective_s, 12), v.tp_degree, v.zero_group, s.one_node)
    return sorted(found, key=key), records


def sync_bound_s(tables: CostTables, configs: list[Config], items: list[ilp.Item], options: SearchOptions,
                 min_replicas: int) -> float:
    """bounds.sync_bound_s over the variant's items, with each sync group's time per replica level as the
    CP-SAT model charges it, in the regimes it solves (ilp.solve_regimes)."""
    syncs = {one: ilp.ItemSyncs.of(tables, configs, items, one) for one in ilp.regimes(tables, options.use_all_devices)}
    return bounds.sync_bound_s(tables, configs, [(i.config, i.time_ns, i.capacity) for i in items],
                               syncs[False].group_of, {one: s.at_ns for one, s in syncs.items()},
                               syncs[False].grid, min_replicas)


def _taken(solving: tuple[dict[str, float | int | str], Variant, float, Future[list[Solution]]],
           found: list[tuple[Solution, Variant]], best_s: float) -> float:
    """A variant's solve, waited for and absorbed (`_absorb`); the best objective so far."""
    record, variant, t0, future = solving
    solutions = future.result()
    record["solve_s"] = time.perf_counter() - t0
    return _absorb(record, variant, solutions, found, best_s)


def _absorb(record: dict[str, float | int | str], variant: Variant, solutions: list[Solution],
            found: list[tuple[Solution, Variant]], best_s: float) -> float:
    """Add a variant's solutions to those found and its best to its record; the best objective so far."""
    found.extend((s, variant) for s in solutions)
    if not solutions:
        return best_s
    record["objective_s"] = solutions[0].objective_s
    return min(best_s, min(s.objective_s for s in solutions))


def middle_out(degrees: list[int]) -> dict[int, int]:
    """Each of the ascending `degrees`' place when the middle one (the upper of two) goes first, then the
    others by their distance from it in the list, the higher of two as far first: [1, 2, 4, 8] -> 4, 8, 2, 1."""
    mid = len(degrees) // 2
    ordered = sorted(range(len(degrees)), key=lambda i: (abs(i - mid), -i))
    return {degrees[i]: place for place, i in enumerate(ordered)}


def _above(bound_s: float, best_s: float) -> bool:
    """A variant with this lower bound cannot reach the best objective found (beyond rounding to ns)."""
    return bound_s > best_s + 1e-9
