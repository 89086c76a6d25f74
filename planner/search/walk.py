"""A pipeline schedule walked action by action, as backends/sim walks it, on the times of many pipelines at once.

A device runs its actions (planner.core.schedule) in order; a forward waits for its input from the stage
before, a backward for its output's gradient from the stage after and for its own forward, a W (zbh1's
weight gradients) for its own backward. A finished forward or backward hands its output to the next
(previous) stage's device over that device's link that way, which carries one transfer at a time.

Which action may run next never depends on the times, so the walk is made once per schedule as a program
of steps (`program`), in an order in which each step comes after its inputs, and run on the times of
many pipelines together (`run`), each step elementwise along the pipelines. Any such order gives every
device's actions the same sums and maxima as the simulator, so a pipeline's number is the same to the
bit alone, among many, or in backends/sim.
"""

from __future__ import annotations

import numpy as np

from planner.core import schedule as sched

NUMPY_FROM_PIPELINES = 8     # pipelines walked together as arrays from this many (`run`)
TO_NEXT, TO_PREVIOUS = 1, 2  # the link a step's output takes (0: none)

# One step, a plain tuple (cheapest to make and read, hundreds of thousands of them):
# (device, duration column, wait, out, link, send column): the device runs for the pipeline's time in that
# column once its input `wait` has arrived (-1: none), then hands its output to slot `out` (-1: none) over
# its `link` (TO_NEXT or TO_PREVIOUS) at the cost in `send column`.
Step = tuple[int, int, int, int, int, int]


def program(actions: list[list[sched.Action]], num_stages: int, num_micro: int) -> tuple[Step, ...]:
    """The steps of `actions` (one list per device, stage k on device k mod devices) in an order the walk
    may run them. Duration columns: stage k's forward k, backward K + k (under zbh1 its input-gradient
    part), W 2K + k; send column k: one transfer between stages k and k + 1 (either way)."""
    K, M, D = num_stages, num_micro, len(actions)

    def slot(backward: bool, stage: int, micro: int) -> int:      # the input of (stage, micro) that way
        return (2 * stage + backward) * M + micro

    # per device: (step, what of its own stage must have run first, what it marks as run; -1: nothing),
    # 3 (stage, micro) + 0: the forward, + 1: the backward
    todo: list[list[tuple[Step, int, int]]] = []
    for d, acts in enumerate(actions):
        mine = []
        for a in acts:
            k, j = a.stage, a.micro
            own = 3 * (k * M + j)
            if a.kind == "W":
                mine.append(((d, 2 * K + k, -1, -1, 0, 0), own + 1, -1))
                continue
            back = a.kind == "B"
            wait = slot(back, k, j) if (k < K - 1 if back else k > 0) else -1
            nxt = k - 1 if back else k + 1
            out, link = (slot(back, nxt, j), TO_PREVIOUS if back else TO_NEXT) if 0 <= nxt < K else (-1, 0)
            step = (d, K + k if back else k, wait, out, link, k - 1 if back else k)
            mine.append((step, own if back else -1, own + 1 if back else own))
        todo.append(mine)
    sent = bytearray(2 * K * M)           # slot -> its input has been sent
    done = bytearray(3 * K * M)
    blocked: dict[int, int] = {}          # slot (or -1 - own action) -> the device waiting on it
    pos = [0] * D
    runnable = list(range(D - 1, -1, -1))
    steps: list[Step] = []
    while runnable:
        d = runnable.pop()
        mine, p = todo[d], pos[d]
        while p < len(mine):
            step, needs, marks = mine[p]
            wait, out = step[2], step[3]
            if wait >= 0 and not sent[wait]:
                blocked[wait] = d
                break
            if needs >= 0 and not done[needs]:
                blocked[-1 - needs] = d
                break
            if out >= 0:
                sent[out] = 1
                if out in blocked:
                    runnable.append(blocked.pop(out))
            if marks >= 0:
                done[marks] = 1
                if -1 - marks in blocked:
                    runnable.append(blocked.pop(-1 - marks))
            steps.append(step)
            p += 1
        pos[d] = p
    if len(steps) < sum(len(a) for a in actions):
        raise AssertionError(f"schedule of {D} devices, {K} stages, {M} micro-batches stalls")
    return tuple(steps)


def run(steps: tuple[Step, ...], devices: int, durations: np.ndarray, sends: np.ndarray) -> np.ndarray:
    """The walk on P pipelines at once: `durations` (P, columns), `sends` (P, K - 1); the makespan of each
    (P,). Below NUMPY_FROM_PIPELINES pipelines each is walked on Python floats (`run_one`: a numpy
    operation on a few elements costs some ten float operations); the numbers are the same to the bit
    either way (IEEE sums and maxima)."""
    P = durations.shape[0]
    if P < NUMPY_FROM_PIPELINES:
        return np.array([run_one(steps, devices, t.tolist(), x.tolist()) for t, x in zip(durations, sends)],
                        dtype=float)
    free = np.zeros((devices, P))
    links = np.zeros((3, devices, P))
    arrival: dict[int, np.ndarray] = {}
    columns = durations.T
    costs = sends.T
    for d, column, wait, out, link, send in steps:
        t = free[d] if wait < 0 else np.maximum(free[d], arrival.pop(wait))
        t = t + columns[column]
        free[d] = t
        if out >= 0:
            sent = np.maximum(t, links[link, d]) + costs[send]
            links[link, d] = sent
            arrival[out] = sent
    return free.max(axis=0)


def run_one(steps: tuple[Step, ...], devices: int, durations: list[float], sends: list[float]) -> float:
    """`run` of one pipeline, on Python floats."""
    free = [0.0] * devices
    links = [[0.0] * devices for _ in range(3)]
    arrival: dict[int, float] = {}
    for d, column, wait, out, link, send in steps:
        t = free[d] if wait < 0 else max(free[d], arrival.pop(wait))
        t = t + durations[column]
        free[d] = t
        if out >= 0:
            sent = max(t, links[link][d]) + sends[send]
            links[link][d] = sent
            arrival[out] = sent
    return max(free)
