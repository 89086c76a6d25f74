"""Contiguous stage split of the blocks for one pipeline shape, solved with CP-SAT.

Given one device class, a stage count S and a micro-batch size m, choose contiguous block ranges
minimising the slowest stage's time per micro-batch (compute, launches, boundary transfers)
subject to each stage's memory (training state + activations of its in-flight micro-batches
under 1F1B) fitting the device. Exact: CP-SAT proves optimality on these sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from costmodel.tables import ClassTable

NS_PER_S = 1e9


@dataclass(frozen=True)
class Split:
    """Stage s covers blocks bounds[s] .. bounds[s+1]-1."""

    bounds: tuple[int, ...]
    stage_s: tuple[float, ...]        # per micro-batch: compute + launches + boundary transfers
    stage_memory_bytes: tuple[float, ...]
    stage_grad_bytes: tuple[float, ...]
    optimal: bool

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def max_stage_s(self) -> float:
        return max(self.stage_s)


def stage_costs(table: ClassTable, bounds: tuple[int, ...], micro_batch: int, link_bw: float,
                link_lat: float, grad_bytes: tuple[float, ...]) -> Split:
    """Evaluate a given split (used by the solver's result and by baseline strategies)."""
    S = len(bounds) - 1
    times, mems, grads = [], [], []
    for s in range(S):
        blocks = range(bounds[s], bounds[s + 1])
        t = sum((table.fwd_s[b] + table.bwd_s[b]) * micro_batch + table.overhead_s[b] for b in blocks)
        last = bounds[s + 1] - 1
        if s < S - 1:
            t += 2 * (link_lat + table.boundary_bytes[last] * micro_batch / link_bw)
        in_flight = S - s
        mem = sum(table.state_bytes[b] + table.act_bytes[b] * micro_batch * in_flight for b in blocks)
        times.append(t)
        mems.append(mem)
        grads.append(sum(grad_bytes[b] for b in blocks))
    return Split(tuple(bounds), tuple(times), tuple(mems), tuple(grads), optimal=False)


def solve_split(table: ClassTable, num_stages: int, micro_batch: int, link_bw: float, link_lat: float,
                grad_bytes: tuple[float, ...], time_limit_s: float = 10.0) -> Split | None:
    """Best contiguous split into `num_stages` stages, or None when no split fits in memory."""
    N, S = len(table.fwd_s), num_stages
    if S > N:
        return None
    if S == 1:
        only = stage_costs(table, (0, N), micro_batch, link_bw, link_lat, grad_bytes)
        fits = only.stage_memory_bytes[0] <= table.capacity_bytes
        return Split(only.bounds, only.stage_s, only.stage_memory_bytes, only.stage_grad_bytes, True) \
            if fits else None
    t_ns = [round(((table.fwd_s[b] + table.bwd_s[b]) * micro_batch + table.overhead_s[b]) * NS_PER_S)
            for b in range(N)]
    cut_ns = [round(2 * (link_lat + table.boundary_bytes[b] * micro_batch / link_bw) * NS_PER_S)
              for b in range(N)]
    state = [round(table.state_bytes[b]) for b in range(N)]
    act = [round(table.act_bytes[b] * micro_batch) for b in range(N)]
    cap = int(table.capacity_bytes)

    m = cp_model.CpModel()
    # x[b][s]: block b runs in stage s; stages are contiguous and in order.
    x = [[m.NewBoolVar(f"x{b}_{s}") for s in range(S)] for b in range(N)]
    for b in range(N):
        m.AddExactlyOne(x[b])
        for s in range(S):
            if s > b or (N - 1 - b) < (S - 1 - s):
                m.Add(x[b][s] == 0)        # each stage gets at least one block
    stage_of = [sum(s * x[b][s] for s in range(S)) for b in range(N)]
    m.Add(stage_of[0] == 0)
    m.Add(stage_of[N - 1] == S - 1)
    for b in range(N - 1):
        step = stage_of[b + 1] - stage_of[b]
        m.Add(step >= 0)
        m.Add(step <= 1)
    # w[b][s]: stage s ends after block b (a cut that sends activations forward, grads back).
    w = [[m.NewBoolVar(f"w{b}_{s}") for s in range(S - 1)] for b in range(N - 1)]
    for b in range(N - 1):
        for s in range(S - 1):
            m.AddBoolAnd([x[b][s], x[b + 1][s + 1]]).OnlyEnforceIf(w[b][s])
            m.AddBoolOr([x[b][s].Not(), x[b + 1][s + 1].Not()]).OnlyEnforceIf(w[b][s].Not())
    horizon = sum(t_ns) + sum(cut_ns)
    worst = m.NewIntVar(0, horizon, "worst_stage_ns")
    for s in range(S):
        comm = sum(cut_ns[b] * w[b][s] for b in range(N - 1)) if s < S - 1 else 0
        m.Add(sum(t_ns[b] * x[b][s] for b in range(N)) + comm <= worst)
        in_flight = S - s
        m.Add(sum((state[b] + act[b] * in_flight) * x[b][s] for b in range(N)) <= cap)
    m.Minimize(worst)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    stages = [next(s for s in range(S) if solver.Value(x[b][s])) for b in range(N)]
    bounds = [0] + [b + 1 for b in range(N - 1) if stages[b + 1] != stages[b]] + [N]
    result = stage_costs(table, tuple(bounds), micro_batch, link_bw, link_lat, grad_bytes)
    return Split(result.bounds, result.stage_s, result.stage_memory_bytes, result.stage_grad_bytes,
                 optimal=status == cp_model.OPTIMAL)
