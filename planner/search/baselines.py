"""Baseline strategies, to compare the ILP against under one simulator.

Each builds the same objects the ILP returns (candidates.Config with a split.Split, candidates.Choice,
candidates.Solution) and goes through the one `assemble()`, so every plan is made by one code path and
checked by `verify_plan`:

- `uniform`: every device alike: the smallest pipeline depth at which an equal-block split fits
  every device class, one replica per group of that many devices, equal batch shares.
- `fastest`: only the devices of the fastest type; the depth and micro-batch size with the best
  estimate, time-balanced stages (the exact split), equal shares.
- `megatron`: what Megatron users do: tensor parallelism across the GPUs of a node (the largest degree
  the model's pairs divide that every class's nodes hold, costmodel.tensor_parallel), the fewest
  pipeline stages at which equal blocks per stage fit, the rest data parallel with equal shares.
- `metis`: Metis-style: per tensor-parallel degree the model allows, one depth, stages balanced by each
  device type's own block times, batch shares proportional to each replica's steady-state speed; the
  best degree, depth and micro-batch size. Every stage of a plan shares one degree (as in the ILP's
  search, planner.search.degrees, which says why).

`uniform`, `fastest`, `single` and `dp` run at degree 1. A baseline returns its solution with the
tables it was priced on (the degree's), which `assemble()` reads the degree from.

And the two plans a user would try first (FIRST_TRIES; always among the runners-up, planner.runners_up):

- `single`: the best plan on one device: every device type that holds the model alone, one stage,
  every micro-batch size (recompute where nothing fits without it); the best estimate. Exhaustive
  over that space, so it reports itself OPTIMAL.
- `dp`: the best pure data-parallel plan: one stage per replica on the devices that hold the model,
  replica counts, shares and micro-batches as the ILP chooses them: the CP-SAT model of
  planner.search.ilp over the one-stage candidates only.

Estimates use the ILP's formulas (pipeline time per replica; gradient sync as planner.search.sync
charges it), with the exact replica count; where the replicas' splits do not nest (metis' per-class
splits; planner.search.align), their fragmented gradient groups run one after another, and the sync
is that chain, as the simulator runs it (baseline_costs.fragmented_sync_s). A depth and micro-batch size
whose compute bound (baseline_costs.layout_bound_s) cannot beat the best estimate so far is skipped: it
could not be chosen. A baseline that cannot fit the model raises PlanningError saying why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

from costmodel import memory, tensor_parallel
from costmodel.tables import ClassTable, CostTables
from passes.verify import verify_plan
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec, Link
from planner.core.errors import PlanningError
from planner.core.ir import Plan, PlanInputs
from planner.search import align, candidates, ilp, topology
from planner.search.assemble import assemble
from planner.search.baseline_costs import BOUND_SLACK, fragmented_sync_s, layout_bound_s, pipelines_per_class
from planner.search.compressors import with_compressor_room
from planner.search.configs import build_configs, micro_batch_options, overlap_of, stage_count_options
from planner.search.explain import GIB
from planner.search.options import SearchOptions
from planner.search.split import equal_bounds, solve_split, stage_costs
from planner.search.sync import split_sync_s

HEURISTIC_STATUS = "HEURISTIC"      # no optimality proof: the plan reports bound 0 (gap 100%)
Replica = tuple[candidates.Config, int]    # (configuration, batch share)
Priced = tuple[candidates.Solution, CostTables]   # a baseline's solution and the tables it is priced on


def make_config(tables: CostTables, cls: int, num_stages: int, micro_batch: int,
                balanced: bool) -> candidates.Config | None:
    """Configuration of class `cls`: exact time-balanced split or equal blocks; recompute only when
    nothing fits without it (as build_configs). None when no split of this kind fits."""
    table = tables.classes[cls]
    if num_stages > tables.num_blocks:
        return None
    intra = num_stages <= table.per_node
    links = topology.cuts(tables, (cls,) * num_stages)
    split = None
    for recompute in (False, True):
        if balanced:
            split = solve_split(table, num_stages, micro_batch, links, tables.grad_bytes, recompute)
        else:
            candidate = stage_costs(table, equal_bounds(tables.num_blocks, num_stages), micro_batch, links,
                                    tables.grad_bytes, recompute)
            fits = all(memory.fits(mem, table.capacity_bytes) for mem in candidate.stage_memory_bytes)
            split = candidate if fits else None
        if split is not None:
            break
    if split is None:
        return None
    opt = candidates.pipeline_optimizer_s([table] * num_stages, split.bounds)
    return with_compressor_room(tables, [candidates.Config(cls, num_stages, micro_batch, split, opt, intra)])[0]


def replica_time_s(config: candidates.Config, share: int) -> float:
    return config.replica_time_s(len(config.micro_batch_sizes(share)))


def evaluate(tables: CostTables, replicas: list[Replica], status: str = HEURISTIC_STATUS) -> candidates.Solution:
    """A Solution for explicit replicas (config, share), estimated with the ILP's formulas (and, for
    splits that do not nest, the chain their gradient groups run in)."""
    replicas = [(c, share) for c, share in replicas if share > 0]
    pipeline_s = max(replica_time_s(c, share) for c, share in replicas)
    classes = {c.cls for c, _ in replicas}
    cls = next(iter(classes))
    one_node = len(classes) == 1 and sum(len(c.device_classes) for c, _ in replicas) <= tables.classes[cls].per_node
    if one_node:
        link = tables.classes[cls].intra_link
    else:
        link = Link("inter", tables.inter_bandwidth_bytes_s, tables.inter_latency_s)
    # as the ILP charges it (planner.search.sync): each split's slowest stage, tied groups included,
    # less its overlap with the drain
    configs = [c for c, _ in replicas]
    sync_s = max(split_sync_s(tables, c.cls, c.split.bounds, [len(replicas)], link,
                              overlap_of(tables, configs, c.shape, c.split.bounds), c.stage_compressors, c.chunks)[0]
                 for c in dict.fromkeys(configs))
    counts: dict[tuple[candidates.Config, int], int] = {}
    for key in replicas:
        counts[key] = counts.get(key, 0) + 1
    if align.conflicts(list(dict.fromkeys(c.split.bounds for c in configs))):
        sync_s = max(sync_s, fragmented_sync_s(tables, counts, configs, link, pipeline_s))
    choices = tuple(candidates.Choice(c, n, share) for (c, share), n in counts.items())
    return candidates.Solution(choices=choices, pipeline_s=pipeline_s, sync_s=sync_s, objective_s=pipeline_s + sync_s,
                        bound_s=0.0, status=status, configurations=len(counts), one_node=one_node)


def equal_shares(global_batch: int, count: int) -> list[int]:
    base, extra = divmod(global_batch, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def proportional_shares(global_batch: int, speeds: list[float]) -> list[int]:
    """Integer shares proportional to `speeds`, summing to `global_batch` (largest remainder)."""
    total = sum(speeds)
    exact = [global_batch * s / total for s in speeds]
    shares = [math.floor(x) for x in exact]
    order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:global_batch - sum(shares)]:
        shares[i] += 1
    return shares


def _depths(tables: CostTables, classes: Iterable[int], options: SearchOptions) -> list[int]:
    if options.stages is not None:
        return [options.stages] if options.stages <= tables.num_blocks else []
    out: set[int] = set()
    for ci in classes:
        t = tables.classes[ci]
        if not t.num_devices:       # no node of this class holds the tensor-parallel degree
            continue
        out.update(stage_count_options(tables.num_blocks, t.num_devices, t.per_node, None))
    return sorted(out)


def _micro_batches(tables: CostTables, options: SearchOptions) -> list[int]:
    return [options.micro_batch] if options.micro_batch else micro_batch_options(tables.global_batch)


Layout = Callable[[int, int], list[Replica] | None]   # (depth, micro-batch) -> replicas, or None


def _best(tables: CostTables, layout: Layout, depths: list[int], micros: list[int],
          first_fit: bool = False, classes: Sequence[int] | None = None,
          beat_s: float = math.inf) -> candidates.Solution | None:
    """The layout with the smallest estimate over depths and micro-batch sizes (with `first_fit`:
    the smallest depth at which any micro-batch size fits). With `classes` (those the layout may
    use), a depth and size whose layout_bound_s cannot beat the best so far, nor `beat_s` (the
    caller's best elsewhere), is not built: it could not be chosen."""
    best: candidates.Solution | None = None
    for S in depths:
        for m in micros:
            incumbent_s = min(best.objective_s if best is not None else math.inf, beat_s)
            if classes is not None and incumbent_s < math.inf and \
                    layout_bound_s(tables, classes, S, m) > incumbent_s * (1 + BOUND_SLACK):
                continue
            replicas = layout(S, m)
            if not replicas:
                continue
            sol = evaluate(tables, replicas)
            if best is None or sol.objective_s < best.objective_s:
                best = sol
        if first_fit and best is not None:
            break
    return best


def _even_layout(tables: CostTables, classes: list[int], balanced: bool, strict: bool = True) -> Layout:
    """One depth for all classes, pipelines on every whole group of devices, equal shares. With
    `strict`, a depth some class cannot hold is rejected; otherwise that class sits idle."""
    def layout(S: int, m: int) -> list[Replica] | None:
        configs = []
        for ci in classes:
            if not tables.classes[ci].num_devices:    # none at this tensor-parallel degree
                continue
            cfg = make_config(tables, ci, S, m, balanced)
            if cfg is None:
                if strict:
                    return None
                continue
            configs.extend([cfg] * pipelines_per_class(tables.classes[ci], S))
        configs = configs[:tables.global_batch]     # more replicas than samples: the rest stay idle
        if not configs:
            return None
        return list(zip(configs, equal_shares(tables.global_batch, len(configs))))
    return layout


def _metis_layout(tables: CostTables) -> Layout:
    def layout(S: int, m: int) -> list[Replica] | None:
        configs = []
        for ci, table in enumerate(tables.classes):
            if not table.num_devices:    # none at this tensor-parallel degree
                continue
            cfg = make_config(tables, ci, S, m, balanced=True)
            if cfg is not None:
                configs.extend([cfg] * pipelines_per_class(table, S))
        if not configs:
            return None
        speeds = [c.micro_batch / c.split.max_stage_s for c in configs]   # samples/s in steady state
        return list(zip(configs, proportional_shares(tables.global_batch, speeds)))
    return layout


def _fail(name: str, tables: CostTables, why: str) -> PlanningError:
    kinds = ", ".join(f"{t.name} ({t.device_type}, {t.num_devices})" for t in tables.classes)
    return PlanningError(f"baseline `{name}` finds no plan: {why} (device classes: {kinds})",
                         fix="use --strategy ilp, more devices, or devices with more memory")


def uniform_solution(tables: CostTables, options: SearchOptions) -> Priced:
    """Smallest depth whose equal-block split fits every class (else: the classes it fits)."""
    everyone = list(range(len(tables.classes)))
    depths, micros = _depths(tables, everyone, options), _micro_batches(tables, options)
    sol = _best(tables, _even_layout(tables, everyone, balanced=False), depths, micros, first_fit=True,
                classes=everyone) \
        or _best(tables, _even_layout(tables, everyone, balanced=False, strict=False), depths, micros,
                 first_fit=True, classes=everyone)
    if sol is None:
        raise _fail("uniform", tables, "no depth lets an equal-block split fit on any device class")
    return sol, tables


def fastest_solution(tables: CostTables, options: SearchOptions) -> Priced:
    """Only the fastest device type (least compute time per sample over all blocks)."""
    if options.use_all_devices:
        raise PlanningError("baseline `fastest` uses one device type only", field="--use-all-devices",
                            fix="drop --use-all-devices or choose another strategy")
    def time_per_sample_s(t: ClassTable) -> float:
        return sum(t.fwd_s) + sum(t.bwd_s)
    fastest = min(tables.classes, key=lambda t: (time_per_sample_s(t), -t.num_devices)).device_type
    chosen = [ci for ci, t in enumerate(tables.classes) if t.device_type == fastest]
    sol = _best(tables, _even_layout(tables, chosen, balanced=True), _depths(tables, chosen, options),
                _micro_batches(tables, options), classes=chosen)
    if sol is None:
        raise _fail("fastest", tables, f"the model fits on no pipeline of {fastest} devices")
    return sol, tables


def megatron_degree(tables: CostTables, options: SearchOptions) -> int:
    """Megatron's tensor-parallel degree: `--tp` where given, else the largest degree the model's pairs
    divide that every class's nodes hold (TP = GPUs per node where the model allows it)."""
    if options.tp is not None:
        return options.tp
    held = [t for t in tensor_parallel.usable_degrees(tables, tables.shardings)
            if all(c.per_node % t == 0 for c in tables.classes if c.num_devices)]
    return max(held, default=1)


def megatron_solution(tables: CostTables, options: SearchOptions) -> Priced:
    """TP inside nodes, the fewest stages at which equal blocks fit (classes that cannot hold that
    depth sit out), the rest data parallel with equal shares; the best micro-batch size there."""
    degree = megatron_degree(tables, options)
    at_t = tensor_parallel.at_degree(tables, tables.shardings, degree)
    everyone = list(range(len(at_t.classes)))
    sol = _best(at_t, _even_layout(at_t, everyone, balanced=False, strict=False),
                _depths(at_t, everyone, options), _micro_batches(at_t, options), first_fit=True, classes=everyone)
    if sol is None:
        raise _fail("megatron", at_t, f"no depth lets an equal-block split fit on any device class at "
                                      f"tensor-parallel degree {degree}")
    return sol, at_t


def metis_solution(tables: CostTables, options: SearchOptions) -> Priced:
    """Per usable tensor-parallel degree: the best common depth, per-class balanced splits, shares
    proportional to replica speed; the best over the degrees (ties: the lower degree). The degrees are
    tried by their least layout bound first, so a good plan found early prunes the others."""
    tried = []
    for degree in tensor_parallel.usable_degrees(tables, tables.shardings, options.tp, options.use_all_devices):
        at_t = tensor_parallel.at_degree(tables, tables.shardings, degree)
        everyone = list(range(len(at_t.classes)))
        depths, micros = _depths(at_t, everyone, options), _micro_batches(at_t, options)
        least_s = min((layout_bound_s(at_t, everyone, S, m) for S in depths for m in micros), default=math.inf)
        tried.append((least_s, degree, at_t, depths, micros))
    best: tuple[float, int, Priced] | None = None       # (estimate, degree, what it returns)
    for _, degree, at_t, depths, micros in sorted(tried, key=lambda t: (t[0], t[1])):
        sol = _best(at_t, _metis_layout(at_t), depths, micros, classes=list(range(len(at_t.classes))),
                    beat_s=best[0] if best is not None else math.inf)
        if sol is not None and (best is None or (sol.objective_s, degree) < best[:2]):
            best = sol.objective_s, degree, (sol, at_t)
    if best is None:
        raise _fail("metis", tables, "no depth lets a balanced split fit on any device class at any "
                                     "tensor-parallel degree")
    return best[2]


def as_gpipe(tables: CostTables, solution: candidates.Solution) -> candidates.Solution:
    """The baseline's replicas run GPipe (`--schedule gpipe`), re-estimated; they are chosen as 1F1B
    pipelines, as the baselines' own recipes do, and GPipe's memory is checked when the plan is verified."""
    replicas = []
    for c in solution.choices:
        # GPipe holds all its micro-batches: the compressors its stages have room for follow from them
        micro_batches = math.ceil(c.share / c.config.micro_batch)
        gpipe = dataclasses.replace(c.config, schedule="gpipe", max_micro_batches=micro_batches)
        replicas += [(with_compressor_room(tables, [gpipe])[0], c.share)] * c.replicas
    return evaluate(tables, replicas, solution.status)


def single_device_need(tables: CostTables) -> str:
    """Why the model fits on no single device: the least any device type needs to hold it alone (one
    stage, micro-batch 1, activations recomputed) against the most any offers."""
    whole = (0, tables.num_blocks)
    needs = [(stage_costs(t, whole, 1, (), tables.grad_bytes, recompute=True).stage_memory_bytes[0], t)
             for t in tables.classes]
    need, least = min(needs, key=lambda nt: nt[0])
    roomiest = max(tables.classes, key=lambda t: t.capacity_bytes)
    return (f"fits on no single device: needs {need / GIB:.1f} GiB at the least ({least.device_type} in "
            f"{least.precision}, micro-batch 1, recompute); the largest offers {roomiest.capacity_bytes / GIB:.1f} "
            f"GiB ({roomiest.device_type}, after the memory margin)")


def _one_stage_only(name: str, options: SearchOptions) -> None:
    if options.stages not in (None, 1):
        raise PlanningError(f"baseline `{name}` runs one stage per replica, not {options.stages}",
                            field="--stages", fix="drop --stages or choose another strategy")


def single_solution(tables: CostTables, options: SearchOptions) -> candidates.Solution:
    """The best plan on one device (every device type and micro-batch size tried)."""
    _one_stage_only("single", options)
    if options.use_all_devices:
        raise PlanningError("baseline `single` uses one device", field="--use-all-devices",
                            fix="drop --use-all-devices or choose another strategy")
    best: candidates.Solution | None = None
    tried = 0
    for ci in range(len(tables.classes)):
        for m in _micro_batches(tables, options):
            config = make_config(tables, ci, 1, m, balanced=True)
            if config is None:
                continue
            tried += 1
            sol = evaluate(tables, [(config, tables.global_batch)], status="OPTIMAL")
            if best is None or sol.objective_s < best.objective_s:
                best = sol
    if best is None:
        raise PlanningError(f"baseline `single` finds no plan: the model {single_device_need(tables)}",
                            fix="use --strategy ilp (pipelines), or devices with more memory")
    # every one-device plan of the search space was estimated: the best is the optimum of that space
    return dataclasses.replace(best, bound_s=best.objective_s, configurations=tried)


def dp_solution(tables: CostTables, options: SearchOptions) -> candidates.Solution:
    """The best pure data-parallel plan: the ILP over one-stage replicas."""
    _one_stage_only("dp", options)
    configs = build_configs(tables, 1, options.micro_batch, mixed_pipelines=False, schedule=options.schedule)
    if not configs:
        raise PlanningError(f"baseline `dp` finds no plan: the model {single_device_need(tables)}",
                            fix="use --strategy ilp (pipelines), or devices with more memory")
    # its CP-SAT models are not the plan's: never dumped over the search's own (--dump-cp-model)
    settings = dataclasses.replace(options.solver, dump_dir=None)
    found = ilp.solve_regimes(tables, configs, settings, use_all_devices=options.use_all_devices)
    if not found:
        raise PlanningError("baseline `dp` finds no plan within the solver's time limit"
                            + (" on every device" if options.use_all_devices else ""),
                            fix="raise --time-limit" + ("" if not options.use_all_devices else
                                                        ", or drop --use-all-devices"))
    return found[0]


SOLVERS: dict[str, Callable[[CostTables, SearchOptions], Priced]] = {
    "uniform": uniform_solution, "fastest": fastest_solution, "megatron": megatron_solution,
    "metis": metis_solution,
}
# what a user would try first: always among the runners-up (planner.runners_up), also a --strategy
FIRST_TRIES: dict[str, Callable[[CostTables, SearchOptions], candidates.Solution]] = {
    "single": single_solution, "dp": dp_solution,
}


def run(name: str, *, tables: CostTables, blocks: list[Block], spec: ClusterSpec, inputs: PlanInputs,
        options: SearchOptions) -> Plan:
    """Plan with baseline `name` (a key of SOLVERS or FIRST_TRIES); the plan is verified, memory included."""
    if name in SOLVERS:
        solution, tables = SOLVERS[name](tables, options)
    else:
        solution = FIRST_TRIES[name](tables, options)
    if options.schedule == "gpipe" and name != "dp":    # dp's candidates already run the schedule asked for
        solution = as_gpipe(tables, solution)
    plan = assemble(solution=solution, tables=tables, blocks=blocks, spec=spec, inputs=inputs, strategy=name)
    verify_plan(plan, spec)
    return plan
