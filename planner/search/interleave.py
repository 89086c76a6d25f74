"""Interleaved 1F1B in the search: the exact makespan of a pipeline whose devices each run several stages.

A pipeline of K = D x v stages on D devices, stage k on device k mod D (planner.core.schedule.interleaved:
Megatron's virtual pipeline stages). Its fill and drain pass chunks of a device's work, not all of it: with
v chunks per device they take about 1/v of what they take under 1F1B on the same devices, for more
transfers (every chunk boundary crosses to the next device, the last device's back to the first) and more
activations held on the first devices.

The makespan is the schedule walked action by action as backends/sim walks it (a transfer starts when its
stage ends and the sending device's link that way is free). The walk's order does not depend on the times
(an action waits on its inputs, whatever they cost), so it is made once per (devices, chunks, count) as a
program of steps (`_program`) and run on the times of many pipelines at once (`prime`: the ILP's items ask
for every count of each pipeline), each step elementwise along the pipelines: one pipeline's number is the
same to the bit alone or among many.

The counts a replica may run (`counts`): any below two rounds of D micro-batches (one round of fewer than
2D), then whole rounds up to MAX_ROUNDS. Interleaving pays where the micro-batches are few against the
devices (its fill saves (D - 1)(1 - 1/v) stage times of M + D - 1); past MAX_ROUNDS rounds 1F1B loses
under 6% to it at v = 2, and the walk grows with the count.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from planner.core import schedule as sched

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


@dataclass(frozen=True)
class _Step:
    """One action of the walk: device `device` runs stage `stage` (forward or backward) once its input
    `wait` has arrived (-1: none), then hands its output to slot `out` (-1: none) over its link."""

    device: int
    backward: bool
    stage: int
    wait: int
    out: int


@functools.lru_cache(maxsize=1024)
def _program(devices: int, chunks: int, micro_batches: int) -> tuple[_Step, ...]:
    """The interleaved schedule's actions in an order the walk may run them (each after its inputs)."""
    K, M, D = devices * chunks, micro_batches, devices
    actions = sched.interleaved(D, chunks, M)

    def slot(backward: bool, stage: int, micro: int) -> int:   # the input of (stage, micro) that way
        return (2 * stage + backward) * M + micro

    ready: set[int] = set()
    done_f: set[tuple[int, int]] = set()
    pos = [0] * D
    steps: list[_Step] = []
    while len(steps) < 2 * K * M:
        progressed = False
        for d in range(D):
            while pos[d] < len(actions[d]):
                a = actions[d][pos[d]]
                k, j, back = a.stage, a.micro, a.kind == "B"
                wait = slot(back, k, j) if (k < K - 1 if back else k > 0) else -1
                if (wait >= 0 and wait not in ready) or (back and (k, j) not in done_f):
                    break
                nxt = k - 1 if back else k + 1
                out = slot(back, nxt, j) if 0 <= nxt < K else -1
                if out >= 0:
                    ready.add(out)
                if not back:
                    done_f.add((k, j))
                steps.append(_Step(d, back, k, wait, out))
                pos[d] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"interleaved schedule of {D} devices x {chunks} chunks, {M} micro-batches stalls")
    return tuple(steps)


def _run(steps: tuple[_Step, ...], devices: int, fwd: np.ndarray, bwd: np.ndarray, send: np.ndarray) -> np.ndarray:
    """The walk on P pipelines at once: fwd, bwd (P, K), send (P, K - 1); the makespan of each (P,)."""
    P = fwd.shape[0]
    free = np.zeros((devices, P))
    link_f = np.zeros((devices, P))
    link_b = np.zeros((devices, P))
    arrival: dict[int, np.ndarray] = {}
    for st in steps:
        d, k = st.device, st.stage
        t = free[d] if st.wait < 0 else np.maximum(free[d], arrival.pop(st.wait))
        t = t + (bwd[:, k] if st.backward else fwd[:, k])
        free[d] = t
        if st.out >= 0:
            link = link_b if st.backward else link_f
            sent = np.maximum(t, link[d]) + send[:, k - 1 if st.backward else k]
            link[d] = sent
            arrival[st.out] = sent
    return free.max(axis=0)


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
            times = _run(_program(D, chunks, M), D, f, b, x)
            with _LOCK:      # the search builds items on a worker thread (planner.search.ahead)
                for key, seconds in zip(keys, times.tolist()):
                    _MAKESPANS[key] = seconds
                while len(_MAKESPANS) > _KEPT:
                    del _MAKESPANS[next(iter(_MAKESPANS))]
