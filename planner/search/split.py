"""Contiguous stage split of the blocks for one pipeline shape, solved exactly.

Given one device class, a stage count S and a micro-batch size m, choose contiguous block ranges
minimising the slowest stage's time per micro-batch (compute, launches, boundary transfers, each
with the activation compressor the policy picks on its cut: topology.Cut) subject to each stage's
memory (training state + activations of its in-flight micro-batches under 1F1B + the framework's)
fitting the device by the one memory rule (costmodel.memory.fits). A dynamic programme solves it
exactly (the bottleneck contiguous partition, planner.search.bottleneck; alpa's stage construction
does the same); the top-level CP-SAT model then chooses among the shapes. With recompute (activation
checkpointing of the whole stage) a stage keeps only its inputs per in-flight micro-batch and runs each forward
twice. Recompute is decided per stage: where a split may recompute, exactly the stages whose
activations do not fit otherwise do (under 1F1B the first stages hold the most micro-batches, so
they are the ones that need it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from costmodel import constants as C
from costmodel import memory
from costmodel.activation_compression import cut_transfer
from costmodel.tables import ClassTable
from planner.search.bottleneck import LaneArrays, bottleneck_bounds
from planner.search.topology import Cut, Links

NS_PER_S = 1e9


@dataclass(frozen=True)
class Split:
    """Stage s covers blocks bounds[s] .. bounds[s+1]-1."""

    bounds: tuple[int, ...]
    # per micro-batch, as the schedule runs them (planner.search.pipeline): each stage's forward
    # and backward, and one transfer over each cut (either way)
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    send_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]      # per stage: its need at the 1F1B peak (memory.need_bytes)
    stage_grad_bytes: tuple[float, ...]
    optimal: bool
    stage_recompute: tuple[bool, ...]          # per stage: it recomputes its forward in the backward
    send_compressors: tuple[str, ...] = ()     # per cut: the activation compressor its send_s assumes

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def recompute(self) -> bool:
        """Some stage recomputes (the split was made with recompute allowed where it is needed)."""
        return any(self.stage_recompute)

    @property
    def stage_s(self) -> tuple[float, ...]:
        """Per micro-batch: compute + launches + both transfers of the stage's outgoing cut."""
        return tuple(f + b + (2 * self.send_s[s] if s < len(self.send_s) else 0.0)
                     for s, (f, b) in enumerate(zip(self.fwd_s, self.bwd_s)))

    @property
    def max_stage_s(self) -> float:
        return max(self.stage_s)


def block_time_s(table: ClassTable, b: int, micro_batch: int, recompute: bool) -> float:
    """One micro-batch through block b, forward and backward (recompute runs the forward twice)."""
    fwd = table.fwd_s[b] * (2 if recompute else 1)
    return (fwd + table.bwd_s[b]) * micro_batch + table.overhead_s[b] * (1.5 if recompute else 1.0)


def block_phases_s(table: ClassTable, blocks: range, micro_batch: int, recompute: bool) -> tuple[float, float]:
    """One micro-batch's forward and backward through `blocks`, as the program runs them: launches
    split evenly between the two, and recompute's second forward inside the backward (the sum is
    block_time_s's; backends.sim.inputs splits a stage record the same way)."""
    return _phases_s(_over(table.fwd_s, blocks), _over(table.bwd_s, blocks), _over(table.overhead_s, blocks),
                     micro_batch, recompute)


def _phases_s(fwd_sum: float, bwd_sum: float, overhead: float, micro_batch: int,
              recompute: bool) -> tuple[float, float]:
    """block_phases_s from the blocks' summed forward, backward and launch times."""
    fwd, bwd = fwd_sum * micro_batch, bwd_sum * micro_batch
    if recompute:
        return fwd + 0.5 * overhead, bwd + fwd + overhead
    return fwd + 0.5 * overhead, bwd + 0.5 * overhead


def kept_activation_bytes(table: ClassTable, blocks: range, micro_batch: int, in_flight: int,
                          recompute: bool) -> float:
    """Activations a stage holds at peak (costmodel.memory.kept_activation_bytes) on this class's figures."""
    return memory.kept_activation_bytes(_over(table.act_bytes, blocks), max(table.boundary_bytes) if recompute else 0.0,
                                        stage_transient_bytes(table, blocks.start, blocks.stop), micro_batch,
                                        in_flight, recompute)


def stage_transient_bytes(table: ClassTable, lo: int, hi: int) -> float:
    """The backward's working set per sample of a stage of blocks lo..hi-1: its largest block's."""
    return max(table.transient_bytes[lo:hi], default=0.0)


def _over(values: tuple[float, ...], blocks: range) -> float:
    """The sum of `values` over a contiguous block range, in block order (as a loop over it adds)."""
    return sum(values[blocks.start:blocks.stop])


def cut_send(link: Cut | tuple[float, float], nbytes: float, element_bytes: int) -> tuple[float, str]:
    """One transfer of `nbytes` over a cut (either way) and the activation compressor it runs with:
    the one the cut's policy picks (costmodel.activation_compression.cut_transfer), else none."""
    cut = Cut(*link)
    if cut.codec is None:
        return cut.latency_s + nbytes / cut.bandwidth_bytes_s, "none"
    cost = cut_transfer(cut.codec, cut.bandwidth_bytes_s, cut.latency_s, nbytes, element_bytes)
    return cost.time_s / 2, cost.name


def _cut_times_s(link: Cut | tuple[float, float], boundary: np.ndarray, element_bytes: int) -> np.ndarray:
    """Both transfers of a cut after each block (`boundary`: bytes per micro-batch), as cut_send."""
    cut = Cut(*link)
    if cut.codec is None:
        return 2 * (cut.latency_s + boundary / cut.bandwidth_bytes_s)
    return np.array([2 * cut_send(cut, float(x), element_bytes)[0] for x in boundary])


def element_bytes(table: ClassTable) -> int:
    """Bytes per activation element a stage of this class sends (its compute precision)."""
    return C.BYTES_PER_ELEMENT[table.precision]


def stage_costs(table: ClassTable, bounds: tuple[int, ...], micro_batch: int, links: Links,
                grad_bytes: tuple[float, ...], recompute: bool = False) -> Split:
    """Evaluate a given split (used by the solver's result and by baseline strategies); `recompute`:
    stages that do not fit their memory otherwise recompute."""
    return costs_per_stage([table] * (len(bounds) - 1), bounds, micro_batch, links, grad_bytes, recompute)


def costs_per_stage(stage_tables: list[ClassTable], bounds: tuple[int, ...], micro_batch: int, links: Links,
                    grad_bytes: tuple[float, ...], recompute: bool | tuple[bool, ...]) -> Split:
    """Evaluate a given split with stage s costed on stage_tables[s] (one device class per stage);
    with `recompute`, the stages whose activations do not fit their memory otherwise recompute; given per
    stage, exactly those stages (interleaved 1F1B decides per device, planner.search.interleave_configs)."""
    S = len(bounds) - 1
    mems, grads, fwds, bwds, sends, recomputes, codecs = [], [], [], [], [], [], []
    stage_input: dict[int, float] = {}      # per table: the largest boundary (what recompute keeps)
    for s, table in enumerate(stage_tables):
        lo, hi = bounds[s], bounds[s + 1]
        state, act = table.held_state_bytes([range(lo, hi)]), sum(table.act_bytes[lo:hi])
        working = stage_transient_bytes(table, lo, hi)
        mem = memory.need_bytes(state, memory.kept_activation_bytes(act, 0.0, working, micro_batch, S - s, False),
                                table.framework_bytes)
        stage_recompute = recompute[s] if isinstance(recompute, tuple) else \
            recompute and not memory.fits(mem, table.capacity_bytes)
        if stage_recompute:
            largest = stage_input.setdefault(id(table), max(table.boundary_bytes))
            mem = memory.need_bytes(state, memory.kept_activation_bytes(act, largest, working, micro_batch, S - s,
                                                                        True), table.framework_bytes)
        fwd, bwd = _phases_s(sum(table.fwd_s[lo:hi]), sum(table.bwd_s[lo:hi]), sum(table.overhead_s[lo:hi]),
                             micro_batch, stage_recompute)
        if s < S - 1:
            send, codec = cut_send(links[s], table.boundary_bytes[hi - 1] * micro_batch, element_bytes(table))
            sends.append(send)
            codecs.append(codec)
        mems.append(mem)
        grads.append(sum(grad_bytes[lo:hi]))
        fwds.append(fwd)
        bwds.append(bwd)
        recomputes.append(stage_recompute)
    return Split(tuple(bounds), tuple(fwds), tuple(bwds), tuple(sends), tuple(mems), tuple(grads),
                 optimal=False, stage_recompute=tuple(recomputes), send_compressors=tuple(codecs))


def equal_bounds(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Contiguous stages of equal block counts (the first `num_blocks % num_stages` get one more)."""
    size, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return tuple(bounds)


def fits_greedily(table: ClassTable, num_stages: int, micro_batch: int, recompute: bool) -> bool:
    """Exact feasibility test: fill each stage with as many blocks as its memory allows.

    Taking more blocks early never hurts later stages (they face a shorter suffix), so the greedy
    packing fits in S stages iff some contiguous split does. This spares the solver from proving
    infeasibility, which is its slowest case.
    """
    N, S = len(table.fwd_s), num_stages
    stage_input = max(table.boundary_bytes) * micro_batch
    b = 0
    for s in range(S):
        in_flight = S - s
        plain, recomputed = 0.0, stage_input * in_flight     # a stage's memory kept each way so far
        working = 0.0                                        # and its backward's working set
        start = b
        while b < N:
            act = table.act_bytes[b] * micro_batch
            # the block's state, less a tied parameter's a block already in the stage holds
            added = table.state_bytes[b] - sum(n for a, z, n in table.tied_state if z == b and a >= start)
            next_plain = plain + added + act * in_flight
            next_recomputed = recomputed + added + act
            next_working = max(working, stage_transient_bytes(table, b, b + 1) * micro_batch)
            kept = min(next_plain, next_recomputed) if recompute else next_plain   # state + activations
            if not memory.fits(memory.need_bytes(kept + next_working, 0.0, table.framework_bytes),
                               table.capacity_bytes):
                break
            plain, recomputed, working = next_plain, next_recomputed, next_working
            b += 1
        if b == start and b < N:
            return False
    return b == N


def solve_split(table: ClassTable, num_stages: int, micro_batch: int, links: Links,
                grad_bytes: tuple[float, ...], recompute: bool = False) -> Split | None:
    """Best contiguous split into `num_stages` stages, or None when no split fits in memory."""
    if num_stages > len(table.fwd_s) or not fits_greedily(table, num_stages, micro_batch, recompute):
        return None
    bounds = _bottleneck_bounds([_Lane(table, micro_batch, links, recompute, 1.0)], num_stages)
    if bounds is None:
        return None
    return dataclasses.replace(stage_costs(table, bounds, micro_batch, links, grad_bytes, recompute),
                               optimal=True)


@dataclass(frozen=True)
class Lane:
    """One device class's view of a split shared by several classes (planner.search.align)."""

    table: ClassTable
    links: Links                    # the pipeline's cuts (planner.search.ilp.cut_links)
    recompute: bool
    target_s: float                 # the class's own best slowest-stage time (normalises its costs)


def solve_shared_bounds(lanes: list[Lane], num_stages: int, micro_batch: int) -> tuple[int, ...] | None:
    """One split for several classes: minimise the worst class's slowest stage relative to its own
    best (`target_s`), every stage fitting every class's memory. None when no such split fits."""
    return _bottleneck_bounds([_Lane(ln.table, micro_batch, ln.links, ln.recompute,
                                     1.0 / ln.target_s) for ln in lanes], num_stages)


@dataclass(frozen=True)
class _Lane:
    table: ClassTable
    micro_batch: int
    links: Links
    recompute: bool
    scale: float


def solve_mixed_bounds(lanes: list[Lane], stage_lanes: list[int], micro_batch: int) -> tuple[int, ...] | None:
    """Best split of a pipeline whose stage s runs on lanes[stage_lanes[s]] (raw times, no
    normalisation): minimise the slowest stage, every stage fitting its own device."""
    return _bottleneck_bounds([_Lane(ln.table, micro_batch, ln.links, ln.recompute, 1.0)
                               for ln in lanes], len(stage_lanes), stage_lanes)


def _bottleneck_bounds(lanes: list[_Lane], S: int, stage_lanes: list[int] | None = None) -> tuple[int, ...] | None:
    """The exact bottleneck partition (planner.search.bottleneck) over these lanes' block costs: the
    largest scaled stage time (compute, launches, the cut's transfer) over the lanes of each stage
    (`stage_lanes[s]`: one lane per stage; default: every lane on every stage)."""
    return bottleneck_bounds([_lane_arrays(ln) for ln in lanes], S, stage_lanes)


def _lane_arrays(ln: _Lane) -> LaneArrays:
    t, m = ln.table, ln.micro_batch
    N = len(t.fwd_s)
    block_t = np.array([block_time_s(t, b, m, False) for b in range(N)]) * ln.scale
    block_t_rec = np.array([block_time_s(t, b, m, True) for b in range(N)]) * ln.scale
    boundary = np.asarray(t.boundary_bytes, dtype=float) * m
    return LaneArrays(
        pre_s=np.concatenate([[0.0], np.cumsum(block_t)]),
        pre_recompute_s=np.concatenate([[0.0], np.cumsum(block_t_rec)]),
        pre_state_bytes=np.concatenate([[0.0], np.cumsum(t.state_bytes)]),
        pre_act_bytes=np.concatenate([[0.0], np.cumsum(t.act_bytes)]) * m,
        transient_bytes=(np.asarray(t.transient_bytes, dtype=float) if t.transient_bytes else np.zeros(N)) * m,
        cut_s=[_cut_times_s(link, boundary, element_bytes(t)) * ln.scale for link in ln.links],
        stage_input_bytes=max(t.boundary_bytes) * m, framework_bytes=t.framework_bytes,
        capacity_bytes=t.capacity_bytes, recompute=ln.recompute, tied_state=t.tied_state)
