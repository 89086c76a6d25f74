"""The share solver of planner/search/rebalance.py: exact (equal to brute force over every split of the
batch), within its bounds, and cutting shares into micro-batches by the planner's rule."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from planner.core.errors import PlanningError
from planner.search.rebalance import (
    ReplicaSpeed,
    best_micro_batch,
    micro_batch_sizes,
    replica_time_s,
    slowest_s,
    solve_shares,
)


def _compositions(total: int, parts: int, low: int):
    """Every tuple of `parts` integers >= low summing to `total`."""
    for cuts in itertools.combinations(range(total - parts * low + parts - 1), parts - 1):
        bounds = (-1, *cuts, total - parts * low + parts - 1)
        yield tuple(b - a - 1 + low for a, b in zip(bounds, bounds[1:]))


def _brute_force(speeds, global_batch, min_rows=1):
    best = None
    for rows in _compositions(global_batch, len(speeds), min_rows):
        if any(s.max_rows is not None and x > s.max_rows for s, x in zip(speeds, rows)):
            continue
        t = slowest_s(speeds, rows)
        best = t if best is None else min(best, t)
    return best


def _random_speed(rng: random.Random, limited: bool) -> ReplicaSpeed:
    return ReplicaSpeed(seconds_per_row=rng.choice([1e-3, 2e-3, 3e-3]) * rng.uniform(0.5, 2.0),
                        micro_batch=rng.randint(1, 5), num_stages=rng.randint(1, 4),
                        max_rows=rng.randint(2, 9) if limited and rng.random() < 0.5 else None,
                        seconds_per_micro_batch=rng.choice([0.0, 1e-3, 5e-3]),
                        other_micro_batches=tuple(rng.sample([1, 2, 4, 8], rng.randint(0, 2))))


@pytest.mark.parametrize("seed", range(60))
def test_equals_brute_force_on_small_cases(seed):
    rng = random.Random(seed)
    speeds = [_random_speed(rng, limited=seed % 2 == 1) for _ in range(rng.randint(1, 4))]
    global_batch = rng.randint(len(speeds), 14)
    expected = _brute_force(speeds, global_batch)
    if expected is None:                            # the bounds leave no split
        with pytest.raises(PlanningError):
            solve_shares(speeds, global_batch)
        return
    shares = solve_shares(speeds, global_batch)
    assert sum(shares.rows) == global_batch and min(shares.rows) >= 1
    assert all(s.max_rows is None or x <= s.max_rows for s, x in zip(speeds, shares.rows))
    assert shares.slowest_s == pytest.approx(expected, rel=1e-12), (speeds, global_batch, shares)
    assert shares.slowest_s == slowest_s(speeds, shares.rows)


def test_a_replica_three_times_slower_gets_about_a_third_of_the_rows():
    fast, slow = ReplicaSpeed(1e-3, 4, 1), ReplicaSpeed(3e-3, 4, 1)
    assert solve_shares([fast, slow], 24).rows == (18, 6)
    # drift: the first replica becomes the slow one; the work moves to the other
    assert solve_shares([slow, fast], 24).rows == (6, 18)


def test_the_pipeline_fill_counts_against_deeper_replicas():
    # equal speeds per row, but a 3-stage replica pays two more micro-batches of fill and drain
    deep, flat = ReplicaSpeed(1e-3, 2, 3), ReplicaSpeed(1e-3, 2, 1)
    rows = solve_shares([deep, flat], 20).rows
    assert rows[0] < rows[1]
    assert replica_time_s(deep, rows[0]) == pytest.approx(replica_time_s(flat, rows[1]), abs=2e-3)


def test_a_fixed_cost_per_micro_batch_makes_few_rows_dear():
    # per row 3x slower but most of a step fixed: a share of 1 costs nearly what a share of 4 does
    fast = ReplicaSpeed(1e-3, 32, 1, seconds_per_micro_batch=6e-3)
    slow = ReplicaSpeed(3e-3, 32, 1, seconds_per_micro_batch=18e-3)
    assert replica_time_s(slow, 1) == pytest.approx(21e-3)
    assert solve_shares([fast, fast, slow, slow], 32).rows == (15, 15, 1, 1)     # 21 ms each
    # the first device slows down 3x: the fixed cost makes its replica one like the slow ones
    assert solve_shares([slow, fast, slow, slow], 32).rows == (3, 23, 3, 3)      # 29 ms at most
    # a new micro-batch costs its fixed part: 8 rows in micro-batches of 4 pay it twice
    assert replica_time_s(ReplicaSpeed(1e-3, 4, 1, seconds_per_micro_batch=1e-3), 8) == pytest.approx(10e-3)
    assert replica_time_s(ReplicaSpeed(1e-3, 4, 2, seconds_per_micro_batch=1e-3), 8) == pytest.approx(15e-3)


def test_a_replica_may_take_a_larger_micro_batch_where_its_memory_allows():
    # planned at one row, a slow replica would pay the fixed cost per row; allowed 8-row micro-batches
    # it takes its rows in one, and gets more of them
    stuck = ReplicaSpeed(3e-3, 1, 1, seconds_per_micro_batch=18e-3)
    free = ReplicaSpeed(3e-3, 1, 1, seconds_per_micro_batch=18e-3, other_micro_batches=(2, 4, 8))
    fast = ReplicaSpeed(1e-3, 16, 1, seconds_per_micro_batch=6e-3)
    assert replica_time_s(stuck, 4) == pytest.approx(4 * 21e-3)
    assert replica_time_s(free, 4) == pytest.approx(30e-3)
    stuck_shares, free_shares = solve_shares([fast, stuck], 32), solve_shares([fast, free], 32)
    assert stuck_shares.rows[1] < free_shares.rows[1]
    assert free_shares.micro_batches[1] == best_micro_batch(free, free_shares.rows[1]) >= free_shares.rows[1] // 2
    assert free_shares.slowest_s < stuck_shares.slowest_s
    # a pipeline weighs the fill against the fixed cost: equal cost, the planned size wins
    deep = ReplicaSpeed(1e-3, 4, 4, other_micro_batches=(1, 2, 8))
    assert best_micro_batch(deep, 16) == 1                      # no fixed cost: the shortest fill
    assert best_micro_batch(dataclasses.replace(deep, seconds_per_row=0.0, seconds_per_micro_batch=1e-3), 16) == 8


def test_memory_bounds_are_kept():
    speeds = [ReplicaSpeed(1e-3, 2, 1, max_rows=5), ReplicaSpeed(5e-3, 2, 1)]
    assert solve_shares(speeds, 12).rows == (5, 7)


def test_no_split_within_the_bounds_is_refused():
    with pytest.raises(PlanningError, match="memory holds 6 rows"):
        solve_shares([ReplicaSpeed(1e-3, 2, 1, max_rows=3), ReplicaSpeed(1e-3, 2, 1, max_rows=3)], 7)
    with pytest.raises(PlanningError, match="at least 1 row"):
        solve_shares([ReplicaSpeed(1e-3, 2, 1)] * 3, 2)
    with pytest.raises(PlanningError, match="not a speed"):
        solve_shares([ReplicaSpeed(float("nan"), 2, 1)], 2)


def test_equal_inputs_give_equal_shares():
    # every rank solves alone from the same gathered numbers: the answer must not depend on anything else
    speeds = [ReplicaSpeed(1e-3, 3, 2), ReplicaSpeed(1e-3, 3, 2), ReplicaSpeed(2e-3, 3, 1)]
    assert len({solve_shares(speeds, 31) for _ in range(5)}) == 1
    assert solve_shares(speeds, 31).rows[0] >= solve_shares(speeds, 31).rows[1]   # ties: the first listed


def test_micro_batches_follow_the_planners_rule():
    assert micro_batch_sizes(10, 4) == (4, 4, 2)
    assert micro_batch_sizes(8, 4) == (4, 4)
    assert micro_batch_sizes(3, 4) == (3,)
