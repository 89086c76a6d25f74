"""Lower bounds on any plan's iteration time at a variant's tables, cheap enough to skip a variant of the
degree search (planner.search.degrees) before its configurations or its CP-SAT model are built.

Both rest on one fact of the one-stage-per-device schedules (1F1B, GPipe: planner.core.schedule): a
stage is one device doing its micro-batches one after another, and a micro-batch's forward runs stage
0 to S-1 and its backward S-1 to 0. So stage k cannot start before micro-batch 1's forward has passed
the stages before it, and after its last backward the gradient still has to pass them back:

    T >= P_k + M * T_k      for every stage k   (T_k: stage k's forward + backward per micro-batch,
                                                 P_k: the stages before k, M micro-batches)

Over all splits of a pipeline whose stages sum to W, the smallest max_k of the right side has every
k equal: T_k = c (M-1)^k / M^(k+1), so c = W / (1 - (1 - 1/M)^S) (`pipeline_floor_s`; W at M = 1, the
closed form's (M + S - 1) W / S never above it). Transfers, the optimizer and the sync only add. Under
interleaved 1F1B a device runs several stages and the fill is chunk-sized, so those pipelines get the
weaker floor max(W, M W / D) of D devices (`interleaved_floor_s`). Under ZB-H1 the drain carries the
input gradients only and the stages' weight gradients fill it, so those pipelines get the floor of the
busiest stage alone, M W / S (`zero_bubble_floor_s`).

- `pipeline_bound_s`: per device class the floor of every pipeline shape the configurations could have
  (the stage counts configs.stage_count_options offers where split.fits_greedily says the blocks fit,
  every micro-batch size and count), each serving min(M m, B) samples on S devices. A plan of time T
  serves B samples, so sum over classes of devices x the best samples per device among the shapes
  whose floor is at most T must reach B: the least such T. Where configs offers pipelines across two
  classes (planner.search.hetero), their depths are bounded with the cheaper class per block and no
  memory check.
- `items_bound_s`: the same count over the CP-SAT model's own items (planner.search.ilp.pareto_items:
  the real pipeline times), once the configurations are built.
- `sync_bound_s`: that count with the gradient sync too, level by level of the replica grid the model
  charges sync on (planner.search.ilp.group_syncs_ns). A plan whose R replicas lie at level l (grid[l-1]
  < R <= grid[l]) takes T = T_pipe + T_sync >= time_i + sync_g(i)[l] for every item i it uses (T_pipe is
  at least each used item's time, T_sync at least each used group's sync at that level), and its R <=
  grid[l] replicas serve the batch, so R times the largest capacity among those items reaches B. The
  least T meeting both at some level (at least `min_replicas`), in either regime (spread over the
  network; in one node of one class, with the node's link and devices), is a bound on the model's
  optimum. Where the sync is a large part of the step (GPT 1.5B on 64 mixed GPUs: 0.12 of 0.50 s), or
  where a variant's best pipelines need many replicas, it is much closer than `items_bound_s`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence

from costmodel.tables import CostTables
from planner.search import hetero
from planner.search.candidates import Config
from planner.search.configs import MIXED_MAX_DEVICES, micro_batch_options, stage_count_options
from planner.search.interleave_configs import CHUNK_OPTIONS
from planner.search.pipeline import DEFAULT_MAX_MICRO
from planner.search.split import block_time_s, fits_greedily

Shape = tuple[float, int, float]     # (time floor s, device class, samples per device)


def pipeline_floor_s(work_s: float, num_stages: int, micro_batches: int) -> float:
    """The least makespan of M micro-batches through S stages whose per-micro-batch times sum to W."""
    if micro_batches <= 1:
        return work_s
    return work_s / (1.0 - (1.0 - 1.0 / micro_batches) ** num_stages)


def interleaved_floor_s(work_s: float, devices: int, micro_batches: int) -> float:
    """The least makespan of M micro-batches through stages summing to W on D devices each running several
    of them (interleaved 1F1B): the devices share the work, and the first micro-batch passes every stage
    forward, then back."""
    return max(work_s, micro_batches * work_s / devices)


def zero_bubble_floor_s(work_s: float, num_stages: int, micro_batches: int) -> float:
    """The least makespan of M micro-batches through S stages summing to W under ZB-H1: some stage does at
    least a 1/S share of the work of every micro-batch."""
    return micro_batches * work_s / num_stages


def pipeline_bound_s(tables: CostTables, fixed_stages: int | None = None,
                     fixed_micro_batch: int | None = None, interleaved: bool = False,
                     zero_bubble: bool = False) -> float:
    """A lower bound on the pipeline time of every plan these tables allow (inf: no shape fits);
    `interleaved`, `zero_bubble`: the search offers interleaved 1F1B (planner.search.interleave_configs),
    ZB-H1 (planner.search.schedules) too."""
    B = tables.global_batch
    micro_options = [fixed_micro_batch] if fixed_micro_batch else micro_batch_options(B)
    shapes: list[Shape] = []
    held = [ci for ci, c in enumerate(tables.classes) if c.num_devices]
    offered = {ci: stage_count_options(tables.num_blocks, tables.classes[ci].num_devices,
                                       tables.classes[ci].per_node, fixed_stages) for ci in held}
    for m in micro_options:
        work_s: dict[int, float] = {
            ci: sum(block_time_s(tables.classes[ci], b, m, False) for b in range(tables.num_blocks)) for ci in held}
        for ci in held:
            for S in offered[ci]:
                if fits_greedily(tables.classes[ci], S, m, True):
                    shapes.extend(_shapes(ci, work_s[ci], S, m, B))
                    if zero_bubble and S > 1:
                        shapes.extend(_shapes(ci, work_s[ci], S, m, B, zero_bubble_floor_s))
                    # interleaved: S devices of more stages (an S-device pipeline's twins), or S stages on
                    # S / v devices (`--stages` fixes the stages): the floor of each device count
                    for devices in ({S} | {S // v for v in CHUNK_OPTIONS if S % v == 0}) if interleaved else ():
                        if devices >= 2:
                            shapes.extend(_shapes(ci, work_s[ci], devices, m, B, interleaved_floor_s))
    gpus = sum(c.num_devices * c.tp_degree for c in tables.classes)
    if not shapes or gpus <= MIXED_MAX_DEVICES:      # where configs offers pipelines across two classes
        for m in micro_options:
            for first in held:
                for second in held:
                    if first == second:
                        continue
                    # stages on either class: no faster than the cheaper per block; memory not checked
                    cheaper_s = sum(min(block_time_s(tables.classes[ci], b, m, False) for ci in (first, second))
                                    for b in range(tables.num_blocks))
                    for S in hetero.stage_count_options(tables, first, second):
                        for ci in (first, second):
                            shapes.extend(_shapes(ci, cheaper_s, S, m, B))
                            if zero_bubble:
                                shapes.extend(_shapes(ci, cheaper_s, S, m, B, zero_bubble_floor_s))
    return _least_time_s(tables, shapes)


def items_bound_s(tables: CostTables, configs: list[Config], items: Iterable[tuple[int, int, int]]) -> float:
    """The same bound over the CP-SAT model's items ((configuration, time ns, capacity) each)."""
    shapes: list[Shape] = []
    for k, time_ns, capacity in items:
        classes = configs[k].device_classes
        shapes.extend((time_ns / 1e9, ci, capacity / len(classes)) for ci in set(classes))
    return _least_time_s(tables, shapes)


def sync_bound_s(tables: CostTables, configs: list[Config], items: Sequence[tuple[int, int, int]],
                 group_of: Sequence[int], group_syncs_ns: Mapping[bool, Sequence[Sequence[int]]],
                 grid: Sequence[int], min_replicas: int = 1) -> float:
    """The bound above (module docstring) over `items` ((configuration, time ns, capacity) each), `group_of`
    each item's sync group and `group_syncs_ns[one_node][group]` its sync at each level of `grid`
    (inf where no level admits a plan)."""
    best_ns = float("inf")
    for one_node, syncs in group_syncs_ns.items():
        groups = _GroupFronts.of(tables, configs, items, group_of, one_node)
        for level, most in enumerate(grid):
            if most < min_replicas or (level and grid[level - 1] >= most):
                continue
            at = [s[level] for s in syncs]
            if not groups.serves(best_ns - 1, at, most):     # no better than a level already found
                continue
            candidates = sorted({t + at[g] for g, times in enumerate(groups.times) for t in times})
            lo, hi = 0, len(candidates) - 1
            while lo < hi:                                  # the least candidate time that serves the batch
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if groups.serves(candidates[mid], at, most) else (mid + 1, hi)
            best_ns = min(best_ns, candidates[lo])
    return best_ns / 1e9


class _GroupFronts:
    """Per sync group, its items by time, with the running largest capacity and samples per device of
    each class; `serves` asks whether the items within a time serve the batch at one level."""

    def __init__(self, tables: CostTables, one_node: bool, times: list[list[int]], capacity: list[list[int]],
                 per_device: list[list[list[float]]]) -> None:
        self.tables, self.one_node = tables, one_node
        self.times, self.capacity, self.per_device = times, capacity, per_device

    @staticmethod
    def of(tables: CostTables, configs: list[Config], items: Sequence[tuple[int, int, int]],
           group_of: Sequence[int], one_node: bool) -> _GroupFronts:
        n_groups, n_classes = max(group_of, default=-1) + 1, len(tables.classes)
        by_group: list[list[tuple[int, int, int]]] = [[] for _ in range(n_groups)]
        for item, g in zip(items, group_of):
            if not (one_node and configs[item[0]].stage_classes):    # one node: single-class pipelines only
                by_group[g].append(item)
        times, capacity, per_device = [], [], []
        for group in by_group:
            group.sort(key=lambda it: it[1])
            most, rates = 0, [0.0] * n_classes
            caps, rows = [], []
            for k, _, cap in group:
                classes = configs[k].device_classes
                most = max(most, cap)
                rates = list(rates)
                for ci in set(classes):
                    rates[ci] = max(rates[ci], cap / len(classes))
                caps.append(most)
                rows.append(rates)
            times.append([it[1] for it in group])
            capacity.append(caps)
            per_device.append(rows)
        return _GroupFronts(tables, one_node, times, capacity, per_device)

    def serves(self, time_ns: float, at: Sequence[int], replicas: int) -> bool:
        """Whether the items with time + their group's sync `at` within `time_ns` serve the global batch
        with at most `replicas` replicas and the classes' devices."""
        B, classes = self.tables.global_batch, self.tables.classes
        most, rates = 0, [0.0] * len(classes)
        for g, times in enumerate(self.times):
            k = bisect.bisect_right(times, time_ns - at[g])
            if k:
                most = max(most, self.capacity[g][k - 1])
                rates = [max(r, x) for r, x in zip(rates, self.per_device[g][k - 1])]
        if replicas * most < B:
            return False
        if self.one_node:   # one class, one node of it
            return any(min(c.per_node, c.num_devices) * r >= B for c, r in zip(classes, rates))
        return sum(c.num_devices * r for c, r in zip(classes, rates)) >= B


def _shapes(cls: int, work_s: float, num_stages: int, micro_batch: int, global_batch: int,
            floor: Callable[[float, int, int], float] = pipeline_floor_s) -> Iterable[Shape]:
    most = min(DEFAULT_MAX_MICRO, -(-global_batch // micro_batch))
    for M in range(1, most + 1):
        yield floor(work_s, num_stages, M), cls, min(M * micro_batch, global_batch) / num_stages


def _least_time_s(tables: CostTables, shapes: list[Shape]) -> float:
    """The least time T at which the classes' devices, each serving the most samples per device of a
    shape whose time is at most T, serve the global batch (inf if they never do)."""
    best = [0.0] * len(tables.classes)
    for time_s, ci, per_device in sorted(shapes):
        if per_device > best[ci]:
            best[ci] = per_device
            if sum(c.num_devices * r for c, r in zip(tables.classes, best)) >= tables.global_batch:
                return time_s
    return float("inf")
