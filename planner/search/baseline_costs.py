"""What the baselines charge and bound beyond the ILP's formulas (planner.search.baselines).

- `fragmented_sync_s`: replicas whose splits do not nest (metis' per-class balanced splits; the ILP
  never combines such splits, planner.search.align) sync in fragmented gradient groups that run one
  after another; the simulator charges that chain, so the baselines' estimate does too
  (planner.search.sync.chained_sync_end_s).
- `layout_bound_s`: a lower bound on any estimate of a depth and micro-batch size, from compute
  alone, so the baselines skip what could not be chosen without building its splits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from costmodel.tables import ClassTable, CostTables
from planner.core.cluster import Link
from planner.search import candidates
from planner.search.configs import overlap_of
from planner.search.sync import SyncLane, chained_sync_end_s


def pipelines_per_class(table: ClassTable, num_stages: int) -> int:
    """Pipelines of depth `num_stages` that assemble places without splitting one across nodes
    needlessly: whole pipelines per node, or whole nodes per pipeline."""
    if num_stages <= table.per_node:
        return table.num_nodes * (table.per_node // num_stages)
    return table.num_nodes // math.ceil(num_stages / table.per_node)


def fragmented_sync_s(tables: CostTables, counts: dict[tuple[candidates.Config, int], int],
                       configs: list[candidates.Config], link: Link, pipeline_s: float) -> float:
    """The sync left after `pipeline_s` when the replicas' splits do not nest (per-class balanced splits):
    their gradient groups fragment and run one after another (planner.search.sync.chained_sync_end_s),
    each stage from the end of its last backward, then its optimizer step. The ILP never combines such
    splits (planner.search.align); the simulator charges their chains, so the estimate does too."""
    lanes = []
    for (c, share), n in counts.items():
        drain_s = c.replica_time_s(math.ceil(share / c.micro_batch)) - c.optimizer_s
        overlap = overlap_of(tables, configs, c.shape, c.split.bounds)
        overlap = [overlap[k % len(overlap)] for k in range(c.num_stages)]     # interleaved: per device
        lanes.append(SyncLane(c.cls, c.split.bounds, n, tuple(drain_s - o for o in overlap), c.stage_compressors))
    ends = chained_sync_end_s(tables, lanes, link)
    done_s = max(max(stage_ends) + c.optimizer_s for ((c, _), _), stage_ends in zip(counts.items(), ends))
    return max(done_s - pipeline_s, 0.0)


# a lower bound sums block times in another order than the split's stages do: it prunes only when it
# exceeds the best estimate by more than this relative rounding slack
BOUND_SLACK = 1e-9


def layout_bound_s(tables: CostTables, classes: Sequence[int], num_stages: int, micro_batch: int) -> float:
    """A lower bound on any estimate of `classes`' pipelines of depth `num_stages` at `micro_batch`,
    however the batch is shared: a replica's pipeline takes at least one micro-batch's forward and
    backward through every stage (W), and at least its slowest stage's M micro-batches, so M * W / S.
    The replicas together serve the global batch: the busiest one's M * W / S is at least B / (sum over
    replicas of m * S / W). Compute only (launches included, recompute and transfers left out: they
    only add); inf when no pipeline of this depth is placed."""
    rate, least_s = 0.0, math.inf
    for ci in classes:
        t = tables.classes[ci]
        count = pipelines_per_class(t, num_stages) if t.num_devices else 0
        if count == 0:
            continue
        whole_s = (sum(t.fwd_s) + sum(t.bwd_s)) * micro_batch + sum(t.overhead_s)
        if whole_s <= 0.0:      # free compute bounds nothing
            return 0.0
        rate += count * micro_batch * num_stages / whole_s
        least_s = min(least_s, whole_s)
    return max(tables.global_batch / rate, least_s) if rate > 0 else math.inf
