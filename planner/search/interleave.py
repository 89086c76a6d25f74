"""Interleaved 1F1B in the search: the exact makespan of a pipeline whose devices each run several stages.

A pipeline of K = D x v stages on D devices, stage k on device k mod D (planner.core.schedule.interleaved:
Megatron's virtual pipeline stages). Its fill and drain pass chunks of a device's work, not all of it: with
v chunks per device they take about 1/v of what they take under 1F1B on the same devices, for more
transfers (every chunk boundary crosses to the next device, the last device's back to the first) and more
activations held on the first devices.

The makespan is the schedule walked action by action as backends/sim walks it (planner.search.walk: a
transfer starts when its stage ends and the sending device's link that way is free), made once per
(devices, chunks, count) as a program of steps and run on the times of many pipelines at once (`prime`:
the ILP's items ask for every count of each pipeline): one pipeline's number is the same to the bit alone
or among many.

The counts a replica may run (`counts`): any below two rounds of D micro-batches (one round of fewer than
2D), then whole rounds up to MAX_ROUNDS. Interleaving pays where the micro-batches are few against the
devices (its fill saves (D - 1)(1 - 1/v) stage times of M + D - 1); past MAX_ROUNDS rounds 1F1B loses
under 6% to it at v = 2, and the walk grows with the count.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

import numpy as np

from planner.core import schedule as sched
from planner.search import walk

MAX_ROUNDS = 8
Key = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], int, int]   # fwd, bwd, send, chunks, count
_KEPT = 65536
_MAKESPANS: dict[Key, float] = {}
_LOCK = threading.Lock()


def counts(num_devices: int, most: int) -> list[int]:
    """The micro-batch counts an interleaved replica of `num_devices` devices may run, up to `most`: every
    count below two rounds, then whole rounds up to MAX_ROUNDS (planner.core.schedule needs whole rounds)."""
    most = min(most, MAX_ROUNDS * num_devices)
    first = list(range(1, min(most, 2 * num_devices - 1) + 1))
    return first + list(range(2 * num_devices, most + 1, num_devices))


def split_rows(num_devices: int, rows: int, micro_batch: int) -> tuple[int, ...] | None:
    """A replica's `rows` as micro-batches the interleaved schedule runs: the fewest of at most
    `micro_batch` rows whose count fills whole rounds, the rows spread evenly (the larger first); None
    where no count between ceil(rows / micro_batch) and `rows` does."""
    need = -(-rows // micro_batch)
    count = next((M for M in range(need, rows + 1) if sched.interleaved_rounds(num_devices, M) is not None), None)
    if count is None:
        return None
    base, extra = divmod(rows, count)
    return tuple(base + 1 if i < extra else base for i in range(count))


@functools.lru_cache(maxsize=1024)
def _program(devices: int, chunks: int, micro_batches: int) -> tuple[walk.Step, ...]:
    """The interleaved schedule's actions in an order the walk may run them (planner.search.walk)."""
    return walk.program(sched.interleaved(devices, chunks, micro_batches), devices * chunks, micro_batches)


def makespan_s(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...], chunks: int,
               micro_batches: int) -> float:
    """Seconds from the first forward to the last backward with `micro_batches` micro-batches; `send[k]` is
    one transfer between stages k and k+1 (either way)."""
    key: Key = (fwd, bwd, send, chunks, micro_batches)
    found = _MAKESPANS.get(key)
    if found is None:
        prime([(fwd, bwd, send)], chunks, [micro_batches])
        found = _MAKESPANS[key]
    return found


def prime(pipelines: Iterable[tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]], chunks: int,
          micro_batches: Iterable[int]) -> None:
    """The makespans of every pipeline of `chunks` chunks per device at each count the schedule runs (whole
    rounds, planner.core.schedule.interleaved_rounds), pipelines of one depth walked together."""
    by_depth: dict[int, list[tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]]] = {}
    for p in dict.fromkeys(pipelines):
        by_depth.setdefault(len(p[0]), []).append(p)
    wanted = sorted(set(micro_batches))
    for K, group in by_depth.items():
        D = K // chunks
        f = np.array([p[0] for p in group], dtype=float)
        b = np.array([p[1] for p in group], dtype=float)
        x = np.array([p[2] for p in group], dtype=float).reshape(len(group), K - 1)
        for M in wanted:
            keys = [(*p, chunks, M) for p in group]
            if sched.interleaved_rounds(D, M) is None or all(k in _MAKESPANS for k in keys):
                continue
            times = walk.run(_program(D, chunks, M), D, np.concatenate([f, b], axis=1), x)
            with _LOCK:      # the search builds items on a worker thread (planner.search.ahead)
                for key, seconds in zip(keys, times.tolist()):
                    _MAKESPANS[key] = seconds
                while len(_MAKESPANS) > _KEPT:
                    del _MAKESPANS[next(iter(_MAKESPANS))]
