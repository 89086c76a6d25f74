"""Time of one replica's pipeline under ZB-H1 (planner.core.schedule.zero_bubble_h1), every micro-batch count.

Stage s runs a forward f_s, the input-gradient part of its backward b_s - w_s and the weight-gradient part
w_s per micro-batch; transfers as under 1F1B (planner.search.pipeline: x_s each way over a link that
carries one at a time). Which action may run next never depends on the times (a device runs its list in
order; an action waits for what it reads), so the walk is made once per (stages, count) and run on the
times of many pipelines at once (planner.search.walk): the simulator's sums and maxima, so the makespan is
the simulator's to the bit.

Replaying costs O(S * M) per count, so the search's table of every count (`makespans_s`) replays the
counts up to `exact_up_to(S)` and then every ~1.5x, and interpolates linearly between those: past the
warm-up each further micro-batch adds about one steady-state round (tests/test_zero_bubble.py bounds the
interpolation's error against the simulator). A plan's own estimate replays its count exactly
(`makespan_s`, through Config.replica_time_s).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

import numpy as np

from planner.core import schedule as sched
from planner.search import walk

_TABLES: dict[tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...], int],
              np.ndarray] = {}
_LOCK = threading.Lock()
TABLES_KEPT = 4096


def exact_up_to(num_stages: int) -> int:
    """The counts replayed exactly; larger ones continue the steady state."""
    return max(16, num_stages + 2)


def replayed_counts(num_stages: int, max_micro: int) -> list[int]:
    """The counts `makespans_s` replays: all up to exact_up_to(S), then every ~1.5x, and `max_micro`."""
    counts = list(range(1, min(max_micro, exact_up_to(num_stages)) + 1))
    while counts[-1] < max_micro:
        counts.append(min(max_micro, max(counts[-1] + 1, round(counts[-1] * 1.5))))
    return counts


@functools.lru_cache(maxsize=4096)
def _program(num_stages: int, num_micro: int) -> tuple[walk.Step, ...]:
    """ZB-H1's actions in an order the walk may run them (planner.search.walk)."""
    return walk.program(sched.zero_bubble_h1(num_stages, num_micro), num_stages, num_micro)


def _durations(fwd: tuple[float, ...], bwd: tuple[float, ...], wgrad: tuple[float, ...]) -> list[float]:
    """The walk's duration columns: each stage's forward, its backward's input-gradient part (B), its W."""
    return [*fwd, *(b - w for b, w in zip(bwd, wgrad)), *wgrad]


def makespan_s(fwd: tuple[float, ...], bwd: tuple[float, ...], wgrad: tuple[float, ...],
               send: tuple[float, ...], micro_batches: int) -> float:
    """The makespan with `micro_batches` micro-batches, replayed exactly."""
    return walk.run_one(_program(len(fwd), micro_batches), len(fwd), _durations(fwd, bwd, wgrad), list(send))


Pipeline = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...]]   # fwd, bwd, wgrad, send


def makespans_s(fwd: tuple[float, ...], bwd: tuple[float, ...], wgrad: tuple[float, ...],
                send: tuple[float, ...], max_micro: int) -> np.ndarray:
    """Index M: the makespan with M micro-batches, for M up to `max_micro` (index 0: 0)."""
    key = (fwd, bwd, wgrad, send, max_micro)
    table = _TABLES.get(key)
    if table is None:
        prime([(fwd, bwd, wgrad, send)], max_micro)
        table = _TABLES[key]
    return table


def prime(pipelines: Iterable[Pipeline], max_micro: int) -> None:
    """`makespans_s` of many pipelines at once: those of one depth walked together at each replayed count."""
    by_depth: dict[int, list[Pipeline]] = {}
    for p in dict.fromkeys(pipelines):
        if p + (max_micro,) not in _TABLES:
            by_depth.setdefault(len(p[0]), []).append(p)
    for S, group in by_depth.items():
        counts = replayed_counts(S, max_micro)
        durations = np.array([_durations(f, b, w) for f, b, w, _ in group], dtype=float)
        sends = np.array([x[:S - 1] for *_, x in group], dtype=float).reshape(len(group), S - 1)
        exact = np.stack([walk.run(_program(S, M), S, durations, sends) for M in counts], axis=1)
        everything = np.arange(1, max_micro + 1)
        with _LOCK:          # the search builds items on a worker thread (planner.search.ahead)
            for p, row in zip(group, exact):
                table = np.zeros(max_micro + 1)
                table[1:] = np.interp(everything, counts, row)
                _TABLES[p + (max_micro,)] = table
            while len(_TABLES) > TABLES_KEPT:
                del _TABLES[next(iter(_TABLES))]
