"""Exact time of one replica's pipeline under 1F1B or GPipe, for every micro-batch count at once.

Stage s runs a forward (f_s) and a backward (b_s) per micro-batch; activations go to stage s+1 and
gradients back to stage s-1, sent asynchronously over a link that carries one transfer at a time
(x_s per micro-batch, each way): the schedule backends/sim runs. The closed form
sum(stages) + (M - 1) * slowest stage is exact for equal stages only: it misses how an isolated
slow stage's warm-up forwards overlap the other stages' fill, and how transfers overlap compute.

- M >= S - 1 (every stage has its full warm-up of S-1-s forwards): round k is every stage's k-th
  (forward, backward) pair. A round's forwards depend on the previous round only; its backwards
  on the next stage's backward of the same round: a max-plus scan over stages. Rounds do not
  depend on M; each M's drain (stage s's last S-1-s backwards) starts from stage s's last round and
  is one scan per column, vectorised over M. O(S * M_max) in all.
- M < S - 1 (warm-up cut short): the schedule is walked action by action, O(S * M) per M
  (pipelines deeper than WALK_MAX_STAGES: at powers of two, interpolated between).

`pipeline_s` reads one count from the table of every count (cached per pipeline: the ILP asks for each
count); `pipeline_one_s` computes the same number for one count alone (the baselines and assembly ask
for one count per pipeline), walking only the counts that entry reads.

GPipe (every forward, then every backward) is two flow shops of identical jobs whose machines are the
stages and the links between them: the forwards from stage 0, then the backwards from the last
stage, stage s starting them once its own forwards end. The longest path through such a lattice
crosses each machine once and repeats the slowest machine it crosses M - 1 times, so the makespan is
a maximum over the stage where the path turns from forwards to backwards: O(S) per M.

tests/test_pipeline_time.py checks all of them against backends/sim on random pipelines.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

import numpy as np

# Beyond this depth the short-warm-up counts (M < S - 1) are walked at M = 1, 2, 4, 8, ... only and
# interpolated linearly between them and the exact M = S - 1 (walking every one costs O(S^3) per
# pipeline); the closed form, an upper bound, caps the interpolation.
WALK_MAX_STAGES = 16

# makespans are computed for M up to this (or the next power of two above a larger M) and cached
DEFAULT_MAX_MICRO = 256
TABLES_KEPT = 8192
PRIMED_CELLS = 4096        # pipelines x stages per batch of `prime`: ~4 MB of rounds per 128 counts
WALKS_TOGETHER_FROM = 8    # pipelines of one depth whose short warm-ups `prime` walks together (`walks_s`)
Key = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], int, str]   # fwd, bwd, send, counts, schedule
_TABLES: dict[Key, np.ndarray] = {}
_TABLES_LOCK = threading.Lock()


def pipeline_s(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...], micro_batches: int,
               schedule: str = "1f1b") -> float:
    """The makespan with `micro_batches` micro-batches under `schedule` (the whole table of counts cached
    per pipeline: for callers that ask for every count, as the ILP's candidate items do)."""
    return float(_cached(fwd, bwd, send, table_size(micro_batches), schedule)[micro_batches])


def pipeline_one_s(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...], micro_batches: int,
                   schedule: str = "1f1b") -> float:
    """`pipeline_s` at one count, the same number to the bit, without the table of every count: only the
    walks and the lattice that count's entry reads (cached per pipeline and count). For callers that ask
    for one count per pipeline (the baselines, assembly)."""
    if schedule == "gpipe":      # O(S) per count already
        return pipeline_s(fwd, bwd, send, micro_batches, schedule)
    return _one_cached(fwd, bwd, send, micro_batches, table_size(micro_batches))


def table_size(micro_batches: int) -> int:
    """The table size a count is cached in: DEFAULT_MAX_MICRO, doubled until it holds the count (the ZB-H1
    tables too, planner.search.candidates)."""
    limit = DEFAULT_MAX_MICRO
    while limit < micro_batches:
        limit *= 2
    return limit


def _arrays(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...],
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """f, b and x with x[S-1] = 0 (the last stage sends nothing on), as the walks index them."""
    return (np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float),
            np.append(np.asarray(send, dtype=float), 0.0))


def _cached(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...], max_micro: int,
            schedule: str) -> np.ndarray:
    key: Key = (fwd, bwd, send, max_micro, schedule)
    table = _TABLES.get(key)
    if table is None:
        table = gpipe_makespans_s(fwd, bwd, send, max_micro) if schedule == "gpipe" else \
            makespans_s(fwd, bwd, send, max_micro)
        _keep(key, table)
    return table


def prime(pipelines: Iterable[tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]],
          most: int = DEFAULT_MAX_MICRO) -> None:
    """Make the 1F1B tables pipeline_s reads for counts up to `most`, for many pipelines at once: the
    lattices of pipelines of one depth run together (`_lattices`), in chunks of PRIMED_CELLS
    stage-cells, and so do their short warm-ups' walks (`walks_s`). The tables equal those pipeline_s
    would make one by one, to the bit; the ILP's items at 1024 GPUs ask for some 600 of them, 1.1 s one
    by one."""
    max_micro = table_size(most)
    todo: dict[int, dict[Key, None]] = {}
    for fwd, bwd, send in pipelines:
        key: Key = (fwd, bwd, send, max_micro, "1f1b")
        if len(fwd) > 1 and max_micro >= len(fwd) - 1 and key not in _TABLES:
            todo.setdefault(len(fwd), {})[key] = None
    for S, keyed in todo.items():
        keys = list(keyed)
        chunk = max(1, PRIMED_CELLS // S)
        for i in range(0, len(keys), chunk):
            part = keys[i:i + chunk]
            f = np.array([k[0] for k in part], dtype=float)
            b = np.array([k[1] for k in part], dtype=float)
            x = np.array([(*k[2], 0.0) for k in part], dtype=float)
            rows = _lattices(f, b, x, max_micro)
            walked = {M: walks_s(f, b, x, M) for M in range(1, S - 1) if _walked(S, M, max_micro)} \
                if len(part) >= WALKS_TOGETHER_FROM else {}
            for n, (key, row) in enumerate(zip(part, rows)):
                walks = {M: float(column[n]) for M, column in walked.items()}
                _keep(key, makespans_s(key[0], key[1], key[2], max_micro, lattice=row, walks=walks))


def _keep(key: Key, table: np.ndarray) -> None:
    """Cache a table, the oldest dropped beyond TABLES_KEPT (a process that plans many models)."""
    with _TABLES_LOCK:     # the search builds items on a worker thread (planner.search.ahead)
        _TABLES[key] = table
        while len(_TABLES) > TABLES_KEPT:
            del _TABLES[next(iter(_TABLES))]


def gpipe_makespans_s(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...],
                      max_micro: int) -> np.ndarray:
    """out[M] under GPipe, M = 1 .. max_micro (out[0] = 0); see the module docstring."""
    f, b, x = _arrays(fwd, bwd, send)
    link = np.concatenate([[0.0], np.cumsum(x[:-1])])              # transfers before stage s
    slow_link = np.concatenate([[0.0], np.maximum.accumulate(x[:-1])])
    # turning at stage s: stages 0..s and their links, forward then backward
    fill = np.cumsum(f) + np.cumsum(b) + 2 * link
    slowest = np.maximum(np.maximum.accumulate(f), slow_link) + np.maximum(np.maximum.accumulate(b), slow_link)
    Ms = np.arange(max_micro + 1)
    out = (fill[:, None] + slowest[:, None] * (Ms[None, :] - 1)).max(axis=0)
    out[0] = 0.0
    return out


def closed_form_s(fwd: np.ndarray, bwd: np.ndarray, send: np.ndarray, micro_batches: int) -> float:
    """sum(stage) + (M - 1) * slowest stage, a stage's time counting both its transfers."""
    stage = fwd + bwd
    stage[:-1] += 2 * send
    return float(stage.sum() + (micro_batches - 1) * stage.max())


def makespans_s(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...],
                max_micro: int, lattice: np.ndarray | None = None,
                walks: dict[int, float] | None = None) -> np.ndarray:
    """out[M] = seconds from the first forward to the last backward with M micro-batches, M = 1 ..
    max_micro (out[0] = 0). `send[s]` is one transfer between stages s and s+1 (S - 1 of them).
    `lattice` and `walks` (walk_s by count): this pipeline's `_lattice` at max_micro and its walks,
    where already made (`prime`)."""
    f, b, x = _arrays(fwd, bwd, send)
    S = len(f)
    out = np.zeros(max_micro + 1)
    if S == 1:
        out[1:] = np.arange(1, max_micro + 1) * (f[0] + b[0])
        return out
    if max_micro >= S - 1:
        out[S - 1:] = _lattice(f, b, x, max_micro) if lattice is None else lattice
    short = range(1, min(S - 1, max_micro + 1))
    walked = [M for M in short if _walked(S, M, max_micro)]
    for M in walked:
        out[M] = walks[M] if walks is not None and M in walks else walk_s(f, b, x, M)
    anchors = walked + ([S - 1] if max_micro >= S - 1 else [])
    for lo, hi in zip(anchors, anchors[1:]):
        for M in range(lo + 1, hi):
            between = out[lo] + (out[hi] - out[lo]) * (M - lo) / (hi - lo)
            out[M] = min(between, closed_form_s(f, b, x[:-1], M))
    return out


def _walked(S: int, M: int, max_micro: int) -> bool:
    """Whether makespans_s walks count M < S - 1 (else it interpolates it)."""
    last_short = min(S - 2, max_micro)
    return S <= WALK_MAX_STAGES or M & (M - 1) == 0 or (M == last_short and max_micro < S - 1)


@functools.lru_cache(maxsize=65536)
def _one_cached(fwd: tuple[float, ...], bwd: tuple[float, ...], send: tuple[float, ...], M: int,
                max_micro: int) -> float:
    """makespans_s(fwd, bwd, send, max_micro)[M], computed by the same operations on the entries it reads."""
    f, b, x = _arrays(fwd, bwd, send)
    S = len(f)
    if S == 1:
        return float(M * (f[0] + b[0]))
    if M >= S - 1:
        return float(_lattice(f, b, x, M)[-1])
    if _walked(S, M, max_micro):
        return walk_s(f, b, x, M)
    lo = max(k for k in range(1, M) if _walked(S, k, max_micro))
    hi = next((k for k in range(M + 1, S - 1) if _walked(S, k, max_micro)), S - 1)
    out_lo = np.float64(_one_cached(fwd, bwd, send, lo, max_micro))
    out_hi = np.float64(_one_cached(fwd, bwd, send, hi, max_micro))
    between = out_lo + (out_hi - out_lo) * (M - lo) / (hi - lo)
    return float(min(between, closed_form_s(f, b, x[:-1], M)))


def walk_s(f: np.ndarray, b: np.ndarray, x: np.ndarray, M: int) -> float:
    """The 1F1B schedule (planner.core.schedule.one_f_one_b) walked action by action, as backends/sim
    does: each action starts once its stage is free and its input has arrived, in an order where every
    input is sent before it is read (`_walk_order`), with the simulator's arithmetic."""
    fl, bl, xl = f.tolist(), b.tolist(), x.tolist()
    S = len(fl)
    free = [0.0] * S
    link = [0.0] * (2 * S)                    # per stage: its link down (forwards), then up (gradients)
    arrival = [0.0] * (2 * S * M)             # per (stage, direction, micro-batch): its input's arrival
    for s, forward, read, sent in _walk_order(S, M):
        t = max(free[s], arrival[read]) if read >= 0 else free[s]
        t += fl[s] if forward else bl[s]
        free[s] = t
        if sent >= 0:
            k = s if forward else S + s
            arrival[sent] = link[k] = max(t, link[k]) + (xl[s] if forward else xl[s - 1])
    return max(free)


def walks_s(f: np.ndarray, b: np.ndarray, x: np.ndarray, M: int) -> np.ndarray:
    """`walk_s` of P pipelines of one depth at once: f, b, x of shape (P, S) (x with its last column 0),
    out (P,). The walk's order does not depend on the times (`_walk_order`), so each action is one
    elementwise step along P, each row the number `walk_s` gives that pipeline alone, to the bit."""
    P, S = f.shape
    fc, bc = list(f.T), list(b.T)
    xd, xu = list(x.T), [np.zeros(P)] + list(x.T[:-1])   # a stage's link down sends x[s], up x[s - 1]
    free = [np.zeros(P)] * S
    link = [np.zeros(P)] * (2 * S)
    arrival: dict[int, np.ndarray] = {}
    for s, forward, read, sent in _walk_order(S, M):
        t = np.maximum(free[s], arrival.pop(read)) if read >= 0 else free[s]
        t = t + (fc[s] if forward else bc[s])
        free[s] = t
        if sent >= 0:
            k = s if forward else S + s
            arrival[sent] = link[k] = np.maximum(t, link[k]) + (xd[s] if forward else xu[s])
    return np.max(np.stack(free), axis=0)


@functools.lru_cache(maxsize=256)     # about a hundred (stages, counts) in a search; each 2 x S x M steps
def _walk_order(S: int, M: int) -> tuple[tuple[int, bool, int, int], ...]:
    """The actions of S stages under 1F1B with M micro-batches, each after the action that sends its
    input: (stage, forward, the input slot it reads or -1, the slot it sends to or -1). Stages run their
    own actions in order (`_one_f_one_b_order`) until one waits on an input not yet sent; forwards flow
    down and gradients up, so sweeping the stages both ways in turn finds the order in few sweeps. Which
    input is ready depends only on the order, never on the times, so one order serves every pipeline of
    that shape (and any such order gives the same times: a stage's times depend only on its own actions,
    in its own order, and the arrivals they wait on)."""
    def slot(s: int, forward: bool, j: int) -> int:
        return (2 * s + (0 if forward else 1)) * M + j

    actions = [_one_f_one_b_order(S, s, M) for s in range(S)]
    pos = [0] * S
    sent: set[int] = set()
    order: list[tuple[int, bool, int, int]] = []
    remaining, sweep = 2 * S * M, 0
    down, up = range(S), range(S - 1, -1, -1)
    while remaining:
        sweep += 1
        for s in (down if sweep % 2 else up):
            acts, p = actions[s], pos[s]
            while p < len(acts):
                a = acts[p]
                forward = a >= 0
                j = a if forward else -1 - a
                first = s == 0 if forward else s == S - 1
                read = -1 if first else slot(s, forward, j)
                if read >= 0 and read not in sent:
                    break
                last = s == S - 1 if forward else s == 0
                out = -1 if last else slot(s + 1 if forward else s - 1, forward, j)
                if out >= 0:
                    sent.add(out)
                order.append((s, forward, read, out))
                p += 1
            remaining -= p - pos[s]
            pos[s] = p
    return tuple(order)


def _one_f_one_b_order(S: int, s: int, M: int) -> list[int]:
    """Stage s's actions under 1F1B as ints (forward j: j; backward j: -1 - j): S-s-1 warm-up
    forwards, then one forward and one backward in turn, then the drain (planner.core.schedule)."""
    warm = min(S - s - 1, M)
    order = list(range(warm))
    for i in range(M - warm):
        order += [warm + i, -1 - i]
    return order + [-1 - j for j in range(M - warm, M)]


def _lattice(f: np.ndarray, b: np.ndarray, x: np.ndarray, max_micro: int) -> np.ndarray:
    """Makespans for M = S-1 .. max_micro (see the module docstring)."""
    return _lattices(f[None, :], b[None, :], x[None, :], max_micro)[0]


def _warm_up(fl: list[float], xl: list[float]) -> tuple[list[float], list[float], list[float]]:
    """One pipeline's warm-up (column i: stages 0 .. S-2-i run forward i): per stage, the end of its last
    forward, that forward's input arrival, and the end of its last action."""
    S = len(fl)
    fend, farr, end = [0.0] * S, [0.0] * S, [0.0] * S
    for i in range(S - 1):
        for s in range(S - 1 - i):
            arr = 0.0 if s == 0 else max(fend[s - 1], farr[s]) + xl[s - 1]
            fend[s] = end[s] = max(end[s], arr) + fl[s]
            farr[s] = arr
    return fend, farr, end


def _lattices(f: np.ndarray, b: np.ndarray, x: np.ndarray, max_micro: int) -> np.ndarray:
    """`_lattice` of P pipelines of one depth at once: f, b, x of shape (P, S), out (P, max_micro - S + 2).
    Every operation is elementwise along P (maxima, sums, and cumulative ones along the stages), so each
    row is the number `_lattice` gives that pipeline alone, to the bit; P of them cost about one."""
    P, S = f.shape
    fend, farr, end = np.array([_warm_up(fp, xp) for fp, xp in zip(f.tolist(), x.tolist())]).transpose(1, 0, 2)
    g = x[:, :-1] + b[:, :-1]                  # E(s+1) -> E(s): the gradient's transfer, then s's backward
    G = np.concatenate([np.zeros((P, 1)), np.cumsum(g, axis=1)], axis=1)  # G[s] = g[0] + ... + g[s-1]
    rounds = max_micro                         # the last stage's last round is M - 1
    END = np.empty((rounds + 1, P, S))         # per stage, after r rounds: end of its last action
    BARR = np.empty((rounds + 1, P, S))        # and arrival of its last gradient input
    Fend, Farr, E, Barr = fend, farr, end, np.full((P, S), -np.inf)
    END[0], BARR[0] = E, Barr
    arr_f = np.zeros((P, S))
    for k in range(rounds):
        arr_f[:, 1:] = np.maximum(Fend[:, :-1], Farr[:, 1:]) + x[:, :-1]
        Fnew = np.maximum(E, arr_f) + f
        X = Fnew.copy()
        X[:, :-1] = np.maximum(Fnew[:, :-1], Barr[:, :-1] + x[:, :-1])
        E = np.maximum.accumulate((X + b + G)[:, ::-1], axis=1)[:, ::-1] - G
        Bnew = Barr.copy()
        Bnew[:, :-1] = np.maximum(E[:, 1:], Barr[:, :-1]) + x[:, :-1]
        Fend, Farr, Barr = Fnew, arr_f.copy(), Bnew
        END[k + 1], BARR[k + 1] = E, Barr
    # drain of each M, vectorised over M: stage s starts it after round M - S + s
    Ms = np.arange(S - 1, max_micro + 1)
    stages = np.arange(S)[:, None]
    last = Ms[None, :] - S + stages + 1
    end2 = END[last, :, stages].transpose(2, 0, 1)       # (S, len(Ms), P) -> (P, S, len(Ms))
    barr2 = BARR[last, :, stages].transpose(2, 0, 1)
    for c in range(S - 1):                     # column c: stages 0 .. c run a drain backward
        anchor = end2[:, c + 1]                # stage c+1's backward of the same micro-batch
        X = np.maximum(end2[:, :c + 1], barr2[:, :c + 1] + x[:, :c + 1, None])
        Z = np.concatenate([X + (b[:, :c + 1] + G[:, :c + 1])[:, :, None], (anchor + G[:, c + 1, None])[:, None, :]],
                           axis=1)
        Ec = np.maximum.accumulate(Z[:, ::-1], axis=1)[:, ::-1] - G[:, :c + 2, None]
        barr2[:, :c + 1] = np.maximum(Ec[:, 1:], barr2[:, :c + 1]) + x[:, :c + 1, None]
        end2[:, :c + 1] = Ec[:, :c + 1]
    return end2[:, 0]
