"""benchmarks/sharing_sim.py's event simulation of a host's cores shared by the ranks computing at each
instant, on hand-built steps whose times follow by hand."""

from __future__ import annotations

import pytest

from backends.sim import ReplicaWork, SimInput, StageWork, SyncWork, simulate
from tests.helpers import import_benchmark

sharing_sim = import_benchmark("sharing_sim")


def one_core(n: int) -> float:
    """Wall seconds per CPU second of each of n processes on one core."""
    return max(1.0, float(n))


def _replicas(*work_s: float, sync_s: float | None = None) -> SimInput:
    """One-stage replicas on ranks 0, 1, ...: forward and backward of `work` seconds each as priced for all
    of them on one core; with `sync_s`, one all-reduce of all of them after."""
    replicas = tuple(ReplicaWork(r, "1f1b", (StageWork(r, (w,), (w,), (), (), 0.0),)) for r, w in enumerate(work_s))
    syncs = () if sync_s is None else (SyncWork(0, tuple(range(len(work_s))), sync_s),)
    return SimInput(len(work_s), len(work_s), replicas, syncs)


def test_ranks_busy_all_step_take_what_one_factor_per_host_prices():
    inp = _replicas(1.0, 1.0)
    assert sharing_sim.shared_step_s(inp, one_core, 2.0) == pytest.approx(2.0)
    assert simulate(inp, timeline=False).iteration_s == pytest.approx(2.0)


def test_a_rank_that_finishes_early_hands_its_core_to_the_other():
    """Rank 1 holds 0.5 CPU s, rank 0 1 CPU s: both at half a core until 1.0 s, then rank 0 alone for its last
    0.5 CPU s: 1.5 s, where one factor for the host prices 2.0 s."""
    inp = _replicas(1.0, 0.5)
    assert sharing_sim.shared_step_s(inp, one_core, 2.0) == pytest.approx(1.5)
    assert simulate(inp, timeline=False).iteration_s == pytest.approx(2.0)


def test_a_rank_waiting_at_the_all_reduce_keeps_its_core_only_when_told():
    inp = _replicas(1.0, 0.5, sync_s=0.25)
    assert sharing_sim.shared_step_s(inp, one_core, 2.0) == pytest.approx(1.5 + 0.25)
    assert sharing_sim.shared_step_s(inp, one_core, 2.0, sync_wait_holds_core=True) == pytest.approx(2.0 + 0.25)


def test_pipeline_fill_and_drain_run_on_whole_cores():
    """Two stages of one micro-batch: stage 0's forward, stage 1's forward and backward, stage 0's backward
    never overlap, so each runs on a whole core: 4 x 0.5 CPU s = 2.0 s (one factor for the host: 4.0 s)."""
    stages = (StageWork(0, (1.0,), (1.0,), (0.0,), (), 0.0), StageWork(1, (1.0,), (1.0,), (), (0.0,), 0.0))
    inp = SimInput(2, 1, (ReplicaWork(0, "1f1b", stages),), ())
    assert sharing_sim.shared_step_s(inp, one_core, 2.0) == pytest.approx(2.0)
    assert simulate(inp, timeline=False).iteration_s == pytest.approx(4.0)
