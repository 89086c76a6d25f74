"""Time of one replica's pipeline under ZB-H1 (planner.core.schedule.zero_bubble_h1), every micro-batch count.

Stage s runs a forward f_s, the input-gradient part of its backward b_s - w_s and the weight-gradient part
w_s per micro-batch; transfers as under 1F1B (planner.search.pipeline: x_s each way over a link that
carries one at a time). Which action may run next never depends on the times (a device runs its list in
order; an action waits for what it reads), so the order backends/sim processes the actions in is fixed
per (stages, count): it is recorded once and replayed on the numbers, the same additions and maxima in
the same order as the simulator, so the makespan is the simulator's to the bit.

Replaying costs O(S * M) per count, so the search's table of every count (`makespans_s`) replays the
counts up to `exact_up_to(S)` and then every ~1.25x, and interpolates linearly between those: past the
warm-up each further micro-batch adds about one steady-state round (tests/test_zero_bubble.py bounds the
interpolation's error against the simulator). A plan's own estimate replays its count exactly
(`makespan_s`, through Config.replica_time_s).
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from planner.core import schedule as sched

_TABLES: dict[tuple, np.ndarray] = {}
_LOCK = threading.Lock()
TABLES_KEPT = 4096


def exact_up_to(num_stages: int) -> int:
    """The counts replayed exactly; larger ones continue the steady state."""
    return max(16, 2 * num_stages + 2)


def replayed_counts(num_stages: int, max_micro: int) -> list[int]:
    """The counts `makespans_s` replays: all up to exact_up_to(S), then every ~1.25x, and `max_micro`."""
    counts = list(range(1, min(max_micro, exact_up_to(num_stages)) + 1))
    while counts[-1] < max_micro:
        counts.append(min(max_micro, max(counts[-1] + 1, round(counts[-1] * 1.25))))
    return counts


@functools.lru_cache(maxsize=16384)
def _order(num_stages: int, num_micro: int) -> tuple[tuple[int, str, int], ...]:
    """(stage, kind, micro-batch) in the order the simulator runs them (backends/sim/engine.py)."""
    actions = sched.make("zbh1", num_stages, num_micro)
    pos = [0] * num_stages
    done: set[tuple[int, str, int]] = set()
    out: list[tuple[int, str, int]] = []
    while len(out) < 3 * num_stages * num_micro:
        for d in range(num_stages):
            while pos[d] < len(actions[d]):
                a = actions[d][pos[d]]
                s, j = a.stage, a.micro
                if a.kind == "F":
                    ready = s == 0 or (s - 1, "F", j) in done
                elif a.kind == "W":
                    ready = (s, "B", j) in done
                else:
                    ready = (s, "F", j) in done and (s == num_stages - 1 or (s + 1, "B", j) in done)
                if not ready:
                    break
                done.add((s, a.kind, j))
                out.append((s, a.kind, j))
                pos[d] += 1
    return tuple(out)


def makespan_s(fwd: tuple[float, ...], bwd: tuple[float, ...], wgrad: tuple[float, ...],
               send: tuple[float, ...], micro_batches: int) -> float:
    """The makespan with `micro_batches` micro-batches, replayed exactly."""
    S = len(fwd)
    free = [0.0] * S
    link_fwd = [0.0] * S
    link_bwd = [0.0] * S
    ready_f = [[0.0] * micro_batches for _ in range(S)]    # stage s's forward j may start: its input is there
    ready_b = [[0.0] * micro_batches for _ in range(S)]    # and its backward: the output's gradient is there
    for s, kind, j in _order(S, micro_batches):
        if kind == "F":
            end = max(free[s], ready_f[s][j]) + fwd[s]
            free[s] = end
            if s + 1 < S:
                link_fwd[s] = max(end, link_fwd[s]) + send[s]
                ready_f[s + 1][j] = link_fwd[s]
        elif kind == "B":
            end = max(free[s], ready_b[s][j]) + (bwd[s] - wgrad[s])
            free[s] = end
            if s > 0:
                link_bwd[s] = max(end, link_bwd[s]) + send[s - 1]
                ready_b[s - 1][j] = link_bwd[s]
        else:
            free[s] = free[s] + wgrad[s]
    return max(free)


def makespans_s(fwd: tuple[float, ...], bwd: tuple[float, ...], wgrad: tuple[float, ...],
                send: tuple[float, ...], max_micro: int) -> np.ndarray:
    """Index M: the makespan with M micro-batches, for M up to `max_micro` (index 0: 0)."""
    key = (fwd, bwd, wgrad, send, max_micro)
    table = _TABLES.get(key)
    if table is not None:
        return table
    counts = replayed_counts(len(fwd), max_micro)
    exact = [makespan_s(fwd, bwd, wgrad, send, M) for M in counts]
    table = np.zeros(max_micro + 1)
    table[1:] = np.interp(np.arange(1, max_micro + 1), counts, exact)
    with _LOCK:
        if len(_TABLES) >= TABLES_KEPT:
            _TABLES.clear()
        _TABLES[key] = table
    return table
