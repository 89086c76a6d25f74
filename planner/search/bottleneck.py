"""The bottleneck contiguous partition, solved exactly by a dynamic programme over (stage, end block).

best[s][j] = min over starts i of max(best[s-1][i], cost_s(i..j-1)) among the stages that fit, where
cost_s is the largest scaled stage time (compute, launches, the transfer over the stage's outgoing
cut) over the lanes of stage s. A lane is one device class's view: its block times, memory and cuts
(planner.search.split builds them). The programme is vectorised over the whole (start, end) square
per stage: every block range's time and memory is one subtraction of prefix sums, so a stage costs a
few array operations on the square of its possible starts and ends instead of a Python loop over its end blocks.

Ties between equal bottlenecks go to the latest start: earlier stages take the blocks. Under 1F1B
the first micro-batch reaches the slowest stage after the stages before it, and its gradient drains
back through them, so a slow stage costs least at the front.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel import memory

INF = float("inf")


@dataclass(frozen=True)
class LaneArrays:
    """One lane's prefix sums and cut times, as the programme reads them.

    `cut_s[s][b]` is both transfers of the cut after stage s when block b ends that stage."""

    pre_s: np.ndarray              # (N+1,) cumulative block time per micro-batch, no recompute
    pre_recompute_s: np.ndarray    # (N+1,) the same with the forward run twice
    pre_state_bytes: np.ndarray    # (N+1,) cumulative training state
    pre_act_bytes: np.ndarray      # (N+1,) cumulative activations of one micro-batch
    transient_bytes: np.ndarray    # (N,) the backward's working set of one micro-batch where a block is the largest
    cut_s: list[np.ndarray]        # per cut: (N,) both transfers when that block ends the stage
    stage_input_bytes: float       # the largest boundary of one micro-batch (what recompute keeps)
    framework_bytes: float
    capacity_bytes: float
    recompute: bool                # a stage that does not fit otherwise recomputes
    tied_state: tuple[tuple[int, int, float], ...] = ()   # ClassTable.tied_state: a range holding both counts one less


def bottleneck_bounds(lanes: list[LaneArrays], num_stages: int,
                      stage_lanes: list[int] | None = None) -> tuple[int, ...] | None:
    """The bounds (0 = b_0 < ... < b_S = N) minimising the slowest stage, every stage fitting its
    lanes' memory (`stage_lanes[s]`: the one lane of stage s; default: every lane on every stage);
    None when no split fits."""
    N, S = len(lanes[0].pre_s) - 1, num_stages
    if S > N:
        return None
    # stage s starts at block s or later and ends by block N-(S-1-s) (the later stages need a block
    # each): its (start, end) window is the W x W square rows s.., columns s+1.., W = N-S+1
    W = N - S + 1
    ordered = np.arange(W)[:, None] <= np.arange(W)[None, :]      # start < end within the window
    squares = [_Square(ln) for ln in lanes]
    best = np.full((S, N + 1), INF)
    start_of = np.zeros((S, N + 1), dtype=np.int64)
    prev = np.full(N + 1, INF)
    prev[0] = 0.0                   # the first stage starts at block 0
    for s in range(S):
        slowest = np.zeros((W, W))
        fits = ordered.copy()
        for li, square in enumerate(squares):
            if stage_lanes is None or stage_lanes[s] == li:
                lane_s, lane_fits = square.stage(s, S, W)
                slowest = np.maximum(slowest, lane_s)
                fits &= lane_fits
        cand = np.where(fits, np.maximum(prev[s:s + W, None], slowest), INF)
        latest = W - 1 - np.argmin(cand[::-1, :], axis=0)  # per end: the latest start of the least value
        best[s, s + 1:s + W + 1] = cand[latest, np.arange(W)]
        start_of[s, s + 1:s + W + 1] = latest + s
        prev = best[s]
    if not np.isfinite(best[S - 1][N]):
        return None
    bounds = [N]
    for s in range(S - 1, 0, -1):
        bounds.append(int(start_of[s][bounds[-1]]))
    bounds.append(0)
    return tuple(reversed(bounds))


class _Square:
    """One lane's per-range sums over the (start, end) square, computed once per programme."""

    def __init__(self, ln: LaneArrays) -> None:
        def diff(pre: np.ndarray) -> np.ndarray:
            return pre[None, :] - pre[:, None]
        self.ln = ln
        self.range_s = diff(ln.pre_s)
        self.range_recompute_s = diff(ln.pre_recompute_s) if ln.recompute else self.range_s
        self.state = diff(ln.pre_state_bytes)
        for a, b, nbytes in ln.tied_state:    # ranges (start <= a, end > b) hold both readers of a tied parameter
            self.state[:a + 1, b + 1:] -= nbytes
        self.act = diff(ln.pre_act_bytes)
        # the largest working set over each range: row `start`, column `end` is the max over blocks start..end-1
        n = len(ln.transient_bytes)
        ends = np.where(np.arange(n)[None, :] >= np.arange(n + 1)[:, None], ln.transient_bytes[None, :], 0.0)
        self.working = np.concatenate([np.zeros((n + 1, 1)), np.maximum.accumulate(ends, axis=1)], axis=1)

    def stage(self, s: int, num_stages: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Stage s's time and whether it fits over its window of (start, end) (rows: starts s..,
        columns: ends s+1.., `width` each): the compute of the range plus the outgoing cut's transfer
        when block end-1 ends it (none after the last stage)."""
        ln, in_flight = self.ln, num_stages - s
        rows, cols = slice(s, s + width), slice(s + 1, s + width + 1)
        cut = ln.cut_s[s][s:s + width][None, :] if s < num_stages - 1 else 0.0
        lane_s = self.range_s[rows, cols] + cut
        state, act, working = self.state[rows, cols], self.act[rows, cols], self.working[rows, cols]
        lane_fits = memory.fits(memory.need_bytes(state, act * in_flight + working, ln.framework_bytes),
                                ln.capacity_bytes)
        if ln.recompute:   # as split.costs_per_stage: recompute exactly where plain does not fit
            lane_s = np.where(lane_fits, lane_s, self.range_recompute_s[rows, cols] + cut)
            kept = memory.need_bytes(state + act + working, ln.stage_input_bytes * in_flight, ln.framework_bytes)
            lane_fits = lane_fits | memory.fits(kept, ln.capacity_bytes)
        return lane_s, lane_fits
