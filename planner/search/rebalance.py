"""Batch shares re-solved from measured speeds: the integer split of the global batch across fixed
replicas that minimises the slowest replica's predicted step time.

The program (backends/torchdist/program/rebalance.py) measures, per replica, the compute seconds per
row of its slowest stage; when a replica drifts (thermal limits, a noisy neighbour) it asks this
module for new shares. Stages, devices, schedules and micro-batch sizes stay; only how many rows each
replica takes changes, each share cut into micro-batches by the planner's own rule (assemble).

The solver sees only numbers: per replica its slowest stage's seconds per row and per micro-batch (the
launches and framework work a micro-batch costs whatever its rows), its micro-batch size and the other
sizes its memory allows, its stage count and the most rows its memory allows. A replica of S stages
taking x rows in M = ceil(x / m) micro-batches of m is predicted to take

    t(x, m) = seconds_per_row * (x + (S - 1) * min(m, x)) + seconds_per_micro_batch * (M + S - 1)

the closed form of an equal-stage pipeline (planner.search.pipeline.closed_form_s): its slowest stage
works through every micro-batch, and the fill and drain cost S - 1 more; with several sizes allowed
the replica takes the best, t(x) = min over m of t(x, m). A minimum of non-decreasing functions is
non-decreasing in x, so the min-max share problem is solved exactly by handing out rows one at a time, each to the
replica whose time after taking it is smallest (`solve_shares`): every solution's increments are
B - R * min_rows of the increment times t_r(k), each replica's in order, so its slowest time is at
least the (B - R * min_rows)-th smallest of them (and at least every t_r(min_rows)), which the
greedy attains. O(B log R); tests/test_rebalance_solver.py checks it against brute force.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.errors import PlanningError

MIN_ROWS = 1    # every replica keeps at least one row: its ranks run the schedule and sync gradients


@dataclass(frozen=True)
class ReplicaSpeed:
    """One replica as the share solver sees it."""

    seconds_per_row: float          # its slowest stage's compute seconds per row (measured)
    micro_batch: int                # rows per full micro-batch (the plan's size for this replica)
    num_stages: int
    max_rows: int | None = None     # the most rows whose memory fits (None: no limit)
    seconds_per_micro_batch: float = 0.0   # its slowest stage's fixed compute seconds per micro-batch
    other_micro_batches: tuple[int, ...] = ()  # other sizes whose memory fits (none: only micro_batch)

    @property
    def micro_batch_choices(self) -> tuple[int, ...]:
        """The sizes it may run, the planned one first (it wins ties), then the others ascending."""
        return (self.micro_batch, *sorted(set(self.other_micro_batches) - {self.micro_batch}))


@dataclass(frozen=True)
class Shares:
    rows: tuple[int, ...]           # per replica, summing to the global batch
    micro_batches: tuple[int, ...]  # per replica, the micro-batch size it runs its share in
    slowest_s: float                # the slowest replica's predicted step time under these shares


def micro_batch_sizes(rows: int, micro_batch: int) -> tuple[int, ...]:
    """A share cut into micro-batches as the planner cuts it (1F1B, GPipe): full micro-batches, then the rest."""
    full, rest = divmod(rows, micro_batch)
    return tuple([micro_batch] * full + ([rest] if rest else []))


def time_at_s(speed: ReplicaSpeed, rows: int, micro_batch: int) -> float:
    """The predicted step time of a replica taking `rows` rows in micro-batches of `micro_batch` (t(x, m))."""
    fill = speed.num_stages - 1
    micro_batches = -(-rows // micro_batch)
    return (speed.seconds_per_row * (rows + fill * min(micro_batch, rows))
            + speed.seconds_per_micro_batch * (micro_batches + fill))


def best_micro_batch(speed: ReplicaSpeed, rows: int) -> int:
    """The size among the replica's choices that runs `rows` rows fastest (the first listed on a tie)."""
    return min(speed.micro_batch_choices, key=lambda m: time_at_s(speed, rows, m))


def replica_time_s(speed: ReplicaSpeed, rows: int) -> float:
    """The predicted step time of a replica taking `rows` rows at its best micro-batch size (t(x))."""
    return time_at_s(speed, rows, best_micro_batch(speed, rows))


def slowest_s(speeds: Sequence[ReplicaSpeed], rows: Sequence[int]) -> float:
    """The slowest replica's predicted step time under shares `rows`."""
    return max(replica_time_s(s, x) for s, x in zip(speeds, rows, strict=True))


def solve_shares(speeds: Sequence[ReplicaSpeed], global_batch: int, min_rows: int = MIN_ROWS) -> Shares:
    """The shares (at least `min_rows` each, at most each `max_rows`, summing to `global_batch`) that
    minimise the slowest replica's predicted time; ties go to the replica listed first. PlanningError
    when no shares fit the bounds."""
    _check(speeds, global_batch, min_rows)
    rows = [min_rows] * len(speeds)
    ready = [(replica_time_s(s, min_rows + 1), r) for r, s in enumerate(speeds) if _room(s, min_rows)]
    heapq.heapify(ready)
    for _ in range(global_batch - min_rows * len(speeds)):
        _, r = heapq.heappop(ready)     # _check made sure there is room for every row
        rows[r] += 1
        if _room(speeds[r], rows[r]):
            heapq.heappush(ready, (replica_time_s(speeds[r], rows[r] + 1), r))
    return Shares(tuple(rows), tuple(best_micro_batch(s, x) for s, x in zip(speeds, rows)), slowest_s(speeds, rows))


def _room(speed: ReplicaSpeed, rows: int) -> bool:
    return speed.max_rows is None or rows < speed.max_rows


def _check(speeds: Sequence[ReplicaSpeed], global_batch: int, min_rows: int) -> None:
    if not speeds:
        raise PlanningError("no replica to share the batch across", field="replicas", fix="report this plan")
    for r, s in enumerate(speeds):
        if not (s.seconds_per_row >= 0.0 and s.seconds_per_micro_batch >= 0.0 and s.num_stages >= 1
                and min(s.micro_batch_choices) >= 1):
            raise PlanningError(f"replica {r}: {s} is not a speed to solve shares for", field="replicas",
                                fix="report this run's metrics")
    if min_rows * len(speeds) > global_batch:
        raise PlanningError(f"{len(speeds)} replicas need at least {min_rows} row(s) each, more than the global "
                            f"batch of {global_batch}", field="global_batch", fix="keep the plan's shares")
    if all(s.max_rows is not None for s in speeds):
        room = sum(s.max_rows or 0 for s in speeds)
        if room < global_batch or any((s.max_rows or 0) < min_rows for s in speeds):
            raise PlanningError(f"the replicas' memory holds {room} rows, fewer than the global batch of "
                                f"{global_batch} (or a replica cannot hold {min_rows})", field="global_batch",
                                fix="keep the plan's shares")
    elif any(s.max_rows is not None and s.max_rows < min_rows for s in speeds):
        raise PlanningError(f"a replica's memory holds fewer than {min_rows} row(s)", field="replicas",
                            fix="keep the plan's shares")
