"""Event simulation of one training iteration of a plan.

Per replica, each rank runs its schedule's actions (planner.core.schedule) in order. A forward of
micro-batch j on stage s starts when the rank is free and stage s-1's activations of j have
arrived; a backward when stage s+1's input gradient of j has arrived (under zbh1 the backward is its
input-gradient part, and the weights' part W runs where the schedule puts it, after it). Sends are asynchronous (the
runtime uses isend): a transfer starts when its producer finishes and the sending device's link in
that direction is free, and occupies only that link (under interleaved 1F1B a device runs several
stages, whose transfers to the next device share its link). After its last backward a rank joins its
gradient groups in plan order (every rank issues them in that order): a collective starts when
all member ranks are free and blocks them for its duration (no overlap with compute in v1).
Then each rank runs its optimizer step. Deterministic: no randomness, ties broken by order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from backends.sim.inputs import ReplicaWork, SimInput
from planner.core import schedule as sched
from planner.core.errors import PassError

SYNC_LABEL = "sync"
OPTIMIZER_LABEL = "opt"


class Span(NamedTuple):
    """One interval of one rank's timeline; labels are schedule actions (`0F3`), `sync<g>`, `opt`."""

    rank: int
    label: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    iteration_s: float
    throughput_samples_s: float
    pipeline_s: float                # when the last backward of any rank ends
    busy_s: tuple[float, ...]        # per rank: forward + backward compute
    bubble_fraction: float           # 1 - sum(busy) / (ranks * iteration)
    timeline: tuple[Span, ...]       # by rank, then start time

    def spans_of(self, rank: int) -> list[Span]:
        return [s for s in self.timeline if s.rank == rank]


_Timeline = tuple[list[Span], list[float], list[float]]   # spans by stage index; busy, end per stage


def _run_replica(rep: ReplicaWork, spans: list[Span] | None, busy: list[float],
                 seen: dict[tuple, _Timeline]) -> dict[int, float]:
    """Simulate one replica's pipeline, adding compute time to `busy` (and its spans to `spans`, unless
    None); returns each rank's time of its last action. Replicas with the same work (common: many copies
    of one shape) are simulated once (`seen`) and the timeline is given to each one's ranks."""
    key = (rep.schedule, rep.chunks,
           tuple((w.fwd_s, w.bwd_s, w.wgrad_s, w.send_fwd_s, w.send_bwd_s) for w in rep.stages))
    if key not in seen:
        seen[key] = _timeline(rep)
    local, device_busy, device_end = seen[key]
    ranks = [w.rank for w in rep.stages[:len(device_busy)]]     # each device's rank (its first stage's)
    if spans is not None:
        spans.extend(Span(ranks[sp.rank], sp.label, sp.start_s, sp.end_s) for sp in local)
    for d, r in enumerate(ranks):
        busy[r] += device_busy[d]
    return {r: device_end[d] for d, r in enumerate(ranks)}


def _timeline(rep: ReplicaWork) -> _Timeline:
    """One replica's pipeline, with device indices (stage k on device k mod devices) in place of ranks."""
    K, M = len(rep.stages), rep.num_micro
    D = K // rep.chunks
    spans: list[Span] = []
    busy = [0.0] * D
    actions = sched.make(rep.schedule, K, M, rep.chunks)
    split = sched.weight_split(rep.schedule)
    free = [0.0] * D
    pos = [0] * D
    arrival: dict[tuple[int, str, int], float] = {}   # (stage, kind, micro) -> input ready
    done: set[tuple[int, str, int]] = set()
    link_fwd = [0.0] * D    # device d's link towards the next stage's device, free at
    link_bwd = [0.0] * D    # and towards the previous stage's
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for d in range(D):
            while pos[d] < len(actions[d]):
                a = actions[d][pos[d]]
                s, j = a.stage, a.micro
                work = rep.stages[s]
                if a.kind == "F":
                    ready = s == 0 or (s, "F", j) in arrival
                    dur = work.fwd_s[j]
                elif a.kind == "W":
                    ready = (s, "B", j) in done
                    dur = work.wgrad_s[j]
                else:
                    ready = (s, "F", j) in done and (s == K - 1 or (s, "B", j) in arrival)
                    dur = work.bwd_s[j] - (work.wgrad_s[j] if split else 0.0)
                if not ready:
                    break
                start = max(free[d], arrival.get((s, a.kind, j), 0.0))
                end = start + dur
                free[d] = end
                done.add((s, a.kind, j))
                spans.append(Span(d, str(a), start, end))
                busy[d] += dur
                if a.kind == "F" and s + 1 < K:
                    t0 = max(end, link_fwd[d])
                    link_fwd[d] = t0 + work.send_fwd_s[j]
                    arrival[(s + 1, "F", j)] = link_fwd[d]
                elif a.kind == "B" and s > 0:
                    t0 = max(end, link_bwd[d])
                    link_bwd[d] = t0 + work.send_bwd_s[j]
                    arrival[(s - 1, "B", j)] = link_bwd[d]
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PassError(f"replica {rep.index}: schedule deadlocks in simulation:\n"
                            + sched.format_grid(actions), fix="report this plan")
    return spans, busy, free


def simulate(inp: SimInput, timeline: bool = True) -> SimResult:
    """Simulate one iteration: pipelines, then gradient groups, then optimizer steps. Without `timeline`
    the result's timeline is empty (the times are the same: the spans are only recorded, for a chart)."""
    spans: list[Span] = []
    busy = [0.0] * inp.world_size
    free: dict[int, float] = {}
    seen: dict[tuple, _Timeline] = {}
    for rep in inp.replicas:
        free.update(_run_replica(rep, spans if timeline else None, busy, seen))
    pipeline_s = max(free.values(), default=0.0)
    for sync in sorted(inp.syncs, key=lambda g: g.group):
        members = [r for r in sync.ranks if r in free]
        if not members:
            continue
        start = max(free[r] for r in members)
        end = start + sync.duration_s
        for r in members:
            if timeline:
                spans.append(Span(r, f"{SYNC_LABEL}{sync.group}", start, end))
            free[r] = end
    for rep in inp.replicas:
        for st in rep.stages:
            start = free[st.rank]
            free[st.rank] = start + st.optimizer_s
            if timeline:
                spans.append(Span(st.rank, OPTIMIZER_LABEL, start, free[st.rank]))
    iteration_s = max(free.values(), default=0.0)
    ranks = len(free)
    bubble = 1.0 - sum(busy) / (ranks * iteration_s) if iteration_s > 0 and ranks else 0.0
    ordered = tuple(sorted(spans, key=lambda sp: (sp.rank, sp.start_s, sp.end_s, sp.label)))
    return SimResult(
        iteration_s=iteration_s,
        throughput_samples_s=inp.global_batch / iteration_s if iteration_s > 0 else 0.0,
        pipeline_s=pipeline_s, busy_s=tuple(busy), bubble_fraction=max(bubble, 0.0), timeline=ordered)
