"""Interleaved 1F1B's makespan in the search (planner/search/interleave.py) against the simulator, its
extension over whole rounds against the walk, and what interleaving buys: a fill of chunks."""

from __future__ import annotations

import random

import pytest

from backends.sim.engine import simulate
from backends.sim.inputs import ReplicaWork, SimInput, StageWork
from planner.core import schedule as sched
from planner.search import interleave, walk
from planner.search.interleave_configs import SATURATED_ROUNDS, in_flight_counts
from planner.search.pipeline import pipeline_s


def _random_pipeline(rng: random.Random, stages: int) -> tuple[tuple[float, ...], ...]:
    fwd = tuple(rng.uniform(0.5, 2.0) for _ in range(stages))
    bwd = tuple(2 * f * rng.uniform(0.8, 1.2) for f in fwd)
    send = tuple(rng.choice([0.0, rng.uniform(0.01, 0.8)]) for _ in range(stages - 1))
    return fwd, bwd, send


def _simulated_s(fwd, bwd, send, chunks: int, micro: int) -> float:
    K = len(fwd)
    stages = tuple(StageWork(k % (K // chunks), (fwd[k],) * micro, (bwd[k],) * micro,
                             (send[k],) * micro if k + 1 < K else (), (send[k - 1],) * micro if k else (), 0.0)
                   for k in range(K))
    work = ReplicaWork(0, "interleaved", stages, chunks)
    return simulate(SimInput(K // chunks, micro, (work,), ()), timeline=False).pipeline_s


@pytest.mark.parametrize("devices, chunks", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3), (4, 4)])
def test_the_walk_is_the_simulator(devices: int, chunks: int) -> None:
    rng = random.Random(devices * 10 + chunks)
    for _ in range(4):
        fwd, bwd, send = _random_pipeline(rng, devices * chunks)
        for micro in interleave.counts(devices, 3 * devices):
            assert interleave.makespan_s(fwd, bwd, send, chunks, micro) == pytest.approx(
                _simulated_s(fwd, bwd, send, chunks, micro), rel=1e-12)


def test_many_pipelines_walked_together_give_each_one_s_number() -> None:
    rng = random.Random(7)
    pipelines = [_random_pipeline(rng, 8) for _ in range(5)]
    alone = [interleave.makespan_s(*p, 2, 12) for p in pipelines]
    interleave._MAKESPANS.clear()
    interleave.prime(pipelines, 2, [12])
    assert [interleave.makespan_s(*p, 2, 12) for p in pipelines] == alone


def test_counts_are_whole_rounds_past_two() -> None:
    assert interleave.counts(4, 20) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20]
    assert interleave.counts(4, 1000)[-1] == interleave.MAX_ROUNDS * 4


def test_chunks_shrink_the_fill() -> None:
    """Equal stages, free transfers: 1F1B on D devices of stage time c takes (M + D - 1) c; with v chunks of
    c / v each the fill is a chunk's, (M + (D - 1) / v) c; both run the same work."""
    D, v, M, c = 4, 2, 8, 1.0
    one_f_one_b = pipeline_s((c / 3,) * D, (2 * c / 3,) * D, (0.0,) * (D - 1), M)
    interleaved = interleave.makespan_s((c / 3 / v,) * (D * v), (2 * c / 3 / v,) * (D * v), (0.0,) * (D * v - 1),
                                        v, M)
    assert one_f_one_b == pytest.approx((M + D - 1) * c)
    assert interleaved == pytest.approx((M + (D - 1) / v) * c)


@pytest.mark.parametrize(("devices", "chunks"), [(2, 2), (3, 2), (4, 4), (8, 2)])
def test_in_flight_vectors_give_the_walks_peak(devices: int, chunks: int) -> None:
    """The peak of a device's kept activations, from its undominated in-flight vectors, is the one the
    schedule's action list reaches, whatever each stage keeps per micro-batch."""
    rng = random.Random(devices * 10 + chunks)
    schedule = sched.interleaved(devices, chunks, SATURATED_ROUNDS * devices)
    vectors = in_flight_counts(devices, chunks)
    for _ in range(20):
        acts = [rng.choice([0.0, rng.uniform(0.1, 5.0)]) for _ in range(devices * chunks)]
        for d, actions in enumerate(schedule):
            live = walked = 0.0
            for a in actions:
                live += acts[a.stage] if a.kind == "F" else -acts[a.stage]
                walked = max(walked, live)
            peak = max(sum(n * acts[c * devices + d] for c, n in enumerate(v)) for v in vectors[d])
            assert peak == pytest.approx(walked, rel=1e-12, abs=1e-12)


def test_one_pipeline_walked_on_floats_is_the_many_pipeline_walk_to_the_bit(monkeypatch):
    """A few pipelines are walked one by one on Python floats, many together on numpy arrays: the same
    sums and maxima, so the same makespans whichever way, for every program shape."""
    import numpy as np

    rng = np.random.default_rng(3)
    for devices, chunks in ((2, 2), (3, 3), (4, 2), (8, 4)):
        for count in interleave.counts(devices, 64):
            if interleave.sched.interleaved_rounds(devices, count) is None:
                continue
            program = interleave._program(devices, chunks, count)
            K = devices * chunks
            f, b, x = rng.random((5, K)), rng.random((5, K)), rng.random((5, K - 1))
            monkeypatch.setattr(walk, "NUMPY_FROM_PIPELINES", 1)
            together = walk.run(program, devices, np.concatenate([f, b], axis=1), x)
            monkeypatch.setattr(walk, "NUMPY_FROM_PIPELINES", 100)
            one_by_one = walk.run(program, devices, np.concatenate([f, b], axis=1), x)
            assert together.tolist() == one_by_one.tolist()
