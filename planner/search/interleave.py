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

import numpy as np

from planner.core import schedule as sched

MAX_ROUNDS = 8
NUMPY_FROM_PIPELINES = 8     # pipelines walked together at once from this many (`_run`)
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


# One action of the walk, a plain tuple (cheapest to make and read, hundreds of thousands of them):
# (device, backward, stage, wait, out): the device runs the stage (forward or backward) once its input
# `wait` has arrived (-1: none), then hands its output to slot `out` (-1: none) over its link.
_Step = tuple[int, bool, int, int, int]


@functools.lru_cache(maxsize=1024)
def _program(devices: int, chunks: int, micro_batches: int) -> tuple[_Step, ...]:
    """The interleaved schedule's actions in an order the walk may run them (each after its inputs).

    Each device runs its actions in the schedule's order until one waits on an input not yet sent; the
    action that sends that input wakes it. Any such order gives the walk the same numbers: a device's
    times depend only on its own actions, in its own order, and the arrivals they wait on."""
    K, M, D = devices * chunks, micro_batches, devices

    def slot(backward: bool, stage: int, micro: int) -> int:   # the input of (stage, micro) that way
        return (2 * stage + backward) * M + micro

    todo = []      # per device: (step, index of its (stage, micro): a backward waits on that forward)
    for d, acts in enumerate(sched.interleaved(D, chunks, M)):
        mine = []
        for a in acts:
            k, j, back = a.stage, a.micro, a.kind == "B"
            wait = slot(back, k, j) if (k < K - 1 if back else k > 0) else -1
            nxt = k - 1 if back else k + 1
            out = slot(back, nxt, j) if 0 <= nxt < K else -1
            mine.append(((d, back, k, wait, out), k * M + j))
        todo.append(mine)
    sent = bytearray(2 * K * M)           # slot -> its input has been sent
    forward_done = bytearray(K * M)       # (stage, micro) -> its forward ran
    blocked: dict[int, int] = {}          # slot (or -1 - forward) -> the device waiting on it
    pos = [0] * D
    runnable = list(range(D - 1, -1, -1))
    steps: list[_Step] = []
    while runnable:
        d = runnable.pop()
        mine, p = todo[d], pos[d]
        while p < len(mine):
            step, forward = mine[p]
            _, backward, _, wait, out = step
            if wait >= 0 and not sent[wait]:
                blocked[wait] = d
                break
            if backward and not forward_done[forward]:
                blocked[-1 - forward] = d
                break
            if out >= 0:
                sent[out] = 1
                if out in blocked:
                    runnable.append(blocked.pop(out))
            if not backward:
                forward_done[forward] = 1
                if -1 - forward in blocked:
                    runnable.append(blocked.pop(-1 - forward))
            steps.append(step)
            p += 1
        pos[d] = p
    if len(steps) < 2 * K * M:
        raise AssertionError(f"interleaved schedule of {D} devices x {chunks} chunks, {M} micro-batches stalls")
    return tuple(steps)


def _run(steps: tuple[_Step, ...], devices: int, fwd: np.ndarray, bwd: np.ndarray, send: np.ndarray) -> np.ndarray:
    """The walk on P pipelines at once: fwd, bwd (P, K), send (P, K - 1); the makespan of each (P,).
    Below NUMPY_FROM_PIPELINES pipelines each is walked on Python floats (`_run_one`: a numpy operation
    on a few elements costs some ten float operations); the numbers are the same to the bit either way
    (IEEE sums and maxima)."""
    P = fwd.shape[0]
    if P < NUMPY_FROM_PIPELINES:
        return np.array([_run_one(steps, devices, f.tolist(), b.tolist(), x.tolist())
                         for f, b, x in zip(fwd, bwd, send)], dtype=float)
    free = np.zeros((devices, P))
    link_f = np.zeros((devices, P))
    link_b = np.zeros((devices, P))
    arrival: dict[int, np.ndarray] = {}
    for d, backward, k, wait, out in steps:
        t = free[d] if wait < 0 else np.maximum(free[d], arrival.pop(wait))
        t = t + (bwd[:, k] if backward else fwd[:, k])
        free[d] = t
        if out >= 0:
            link = link_b if backward else link_f
            sent = np.maximum(t, link[d]) + send[:, k - 1 if backward else k]
            link[d] = sent
            arrival[out] = sent
    return free.max(axis=0)


def _run_one(steps: tuple[_Step, ...], devices: int, fwd: list[float], bwd: list[float],
             send: list[float]) -> float:
    """`_run` of one pipeline, on Python floats."""
    free = [0.0] * devices
    link_f = [0.0] * devices
    link_b = [0.0] * devices
    arrival: dict[int, float] = {}
    for d, backward, k, wait, out in steps:
        t = free[d] if wait < 0 else max(free[d], arrival.pop(wait))
        t = t + (bwd[k] if backward else fwd[k])
        free[d] = t
        if out >= 0:
            if backward:
                sent = max(t, link_b[d]) + send[k - 1]
                link_b[d] = sent
            else:
                sent = max(t, link_f[d]) + send[k]
                link_f[d] = sent
            arrival[out] = sent
    return max(free)


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
