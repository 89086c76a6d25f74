"""The search's pipeline time (planner.search.pipeline) against the simulator's schedule walk."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backends.sim.engine import simulate
from backends.sim.inputs import ReplicaWork, SimInput, StageWork
from planner.search import pipeline, topology
from tests import synthetic as syn


def simulated_s(fwd: list[float], bwd: list[float], send: list[float], micro_batches: int,
                schedule: str = "1f1b") -> float:
    S, M = len(fwd), micro_batches
    stages = tuple(StageWork(s, (fwd[s],) * M, (bwd[s],) * M, (send[s],) * M if s + 1 < S else (),
                             (send[s - 1],) * M if s > 0 else (), 0.0) for s in range(S))
    return simulate(SimInput(S, M, (ReplicaWork(0, schedule, stages),), ())).pipeline_s


def random_pipeline(rng: random.Random, max_stages: int,
                    exact_stages: bool = False) -> tuple[list[float], list[float], list[float]]:
    S = max_stages if exact_stages else rng.randint(1, max_stages)
    fwd = [rng.choice([0.5, 1.0, 3.0]) * rng.uniform(0.5, 2.0) for _ in range(S)]
    bwd = [2 * f * rng.uniform(0.5, 1.5) for f in fwd]
    send = [rng.choice([0.0, 0.05, 1.0, 4.0]) * rng.random() for _ in range(S - 1)]
    return fwd, bwd, send


@pytest.mark.parametrize("seed", range(4))
def test_makespans_equal_the_simulated_schedule(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        fwd, bwd, send = random_pipeline(rng, 9)
        most = rng.randint(1, 24)
        got = pipeline.makespans_s(tuple(fwd), tuple(bwd), tuple(send), most)
        for M in range(1, most + 1):
            assert got[M] == pytest.approx(simulated_s(fwd, bwd, send, M), rel=1e-12), (fwd, bwd, send, M)


def test_deep_pipelines_are_exact_where_walked_and_bounded_elsewhere() -> None:
    rng = random.Random(7)
    S = pipeline.WALK_MAX_STAGES + 6
    fwd = [rng.uniform(0.5, 2.0) for _ in range(S)]
    bwd = [2 * f for f in fwd]
    send = [0.1 * rng.random() for _ in range(S - 1)]
    got = pipeline.makespans_s(tuple(fwd), tuple(bwd), tuple(send), S + 3)
    for M in (1, 2, 8, 16, S - 1, S, S + 3):                    # walked, and the lattice
        assert got[M] == pytest.approx(simulated_s(fwd, bwd, send, M), rel=1e-12)
        assert pipeline.pipeline_one_s(tuple(fwd), tuple(bwd), tuple(send), M) == pytest.approx(got[M], rel=1e-12)
    for M in (9, 13, 17, S - 2):                                 # interpolated: close, never above the closed form
        closed = pipeline.closed_form_s(np.array(fwd), np.array(bwd), np.array(send), M)
        assert got[M] <= closed + 1e-9
        assert got[M] == pytest.approx(simulated_s(fwd, bwd, send, M), rel=0.03)


def test_an_isolated_slow_stage_overlaps_the_fill() -> None:
    """Slow first stage (f=b=2) before a fast one (f=b=1), no transfer time: the slow stage never
    waits, so M micro-batches take 4M, where the closed form says 4M + 2."""
    for M in (1, 2, 5, 40):
        got = pipeline.pipeline_s((2.0, 1.0), (2.0, 1.0), (0.0,), M)
        assert got == pytest.approx(4.0 * M + (2.0 if M == 1 else 0.0))
        closed = pipeline.closed_form_s(np.array([2.0, 1.0]), np.array([2.0, 1.0]), np.array([0.0]), M)
        assert closed == pytest.approx(4.0 * M + 2.0)


def test_equal_stages_match_the_closed_form() -> None:
    for S, M in ((1, 7), (4, 2), (4, 3), (4, 16), (8, 100)):
        got = pipeline.pipeline_s((1.0,) * S, (2.0,) * S, (0.0,) * (S - 1), M)
        assert got == pytest.approx(3.0 * (S + M - 1))


def test_counts_beyond_the_cached_range_extend_it() -> None:
    fwd, bwd, send = (1.0, 1.5, 0.7), (2.0, 3.0, 1.4), (0.2, 0.1)
    big = pipeline.DEFAULT_MAX_MICRO * 3
    assert pipeline.pipeline_s(fwd, bwd, send, big) == pytest.approx(simulated_s(list(fwd), list(bwd), list(send), big))


def test_cuts_cross_the_network_where_a_node_or_a_device_type_ends() -> None:
    a = syn.table("a", 1.0, blocks=16, devices=16, per_node=4, intra_gbyte_s=100.0)
    b = syn.table("b", 1.0, blocks=16, devices=8, per_node=4, intra_gbyte_s=50.0)
    tabs = syn.tables([a, b], 64)
    inter = (tabs.inter_bandwidth_bytes_s, tabs.inter_latency_s)
    intra_a = (a.intra_bandwidth_bytes_s, a.intra_latency_s)
    intra_b = (b.intra_bandwidth_bytes_s, b.intra_latency_s)
    assert topology.cut_links(tabs, (0,) * 4) == (intra_a,) * 3                       # one node
    assert topology.cut_links(tabs, (0,) * 8) == (intra_a,) * 3 + (inter,) + (intra_a,) * 3
    assert topology.cut_links(tabs, (0, 0, 1, 1)) == (intra_a, inter, intra_b)        # between types
    assert topology.cut_links(tabs, (0,) * 8 + (1,) * 2) == ((intra_a,) * 3 + (inter,) + (intra_a,) * 3
                                                            + (inter, intra_b))


def test_shared_split_takes_the_candidate_the_schedule_runs_fastest() -> None:
    """A Llama-like profile (light embedding, alternating attention/MLP, heavy head): the split
    balanced on its slowest stage puts a heavy stage last; splits are compared by the 1F1B time."""
    from planner.search import align
    from planner.search.split import equal_bounds

    layer = [2.7e-3, 4.2e-3]
    blocks = [0.3e-3, *(layer * 7), 0.2e-3, 3.7e-3]
    t = syn.table("a", 1.0, blocks=len(blocks), devices=8, per_node=8, block_s=blocks, capacity_gib=80.0)
    tabs = syn.tables([t], 16)
    S, micro = 8, [1]
    own = align.own_splits(tabs, [0], S, micro)
    chosen = align.shared_bounds(tabs, [0], S, micro, own)
    candidates = {own[(0, 1)].bounds, equal_bounds(len(blocks), S)}
    rates = {b: align._rate(tabs, 0, b, micro) for b in candidates | {chosen}}
    assert rates[chosen] == max(rates.values())
    assert len(set(rates.values())) > 1             # the candidates differ: the choice matters


@pytest.mark.parametrize("seed", range(3))
def test_one_count_is_the_tables_entry_to_the_bit(seed: int) -> None:
    """pipeline_one_s computes one count alone (the walks and lattice it reads); it must be the very
    number pipeline_s reads from the table of every count, interpolated counts of deep pipelines too."""
    rng = random.Random(seed)
    for S in (1, 2, 5, pipeline.WALK_MAX_STAGES, pipeline.WALK_MAX_STAGES + 1, 40):
        fwd = tuple(rng.uniform(0.5, 2.0) for _ in range(S))
        bwd = tuple(2 * f * rng.uniform(0.5, 1.5) for f in fwd)
        send = tuple(rng.choice([0.0, 0.05, 1.0]) * rng.random() for _ in range(S - 1))
        for M in (*range(1, S + 3), 100, pipeline.DEFAULT_MAX_MICRO + 5):
            assert pipeline.pipeline_one_s(fwd, bwd, send, M) == pipeline.pipeline_s(fwd, bwd, send, M), (S, M)


def test_the_walk_of_short_warm_ups_is_the_simulated_schedule() -> None:
    rng = random.Random(11)
    for _ in range(30):
        S = rng.randint(3, 24)
        fwd = [rng.uniform(0.5, 2.0) for _ in range(S)]
        bwd = [2 * f * rng.uniform(0.5, 1.5) for f in fwd]
        send = [rng.choice([0.0, 0.3, 2.0]) * rng.random() for _ in range(S - 1)]
        f, b, x = np.array(fwd), np.array(bwd), np.append(np.array(send), 0.0)
        for M in range(1, S - 1):
            assert pipeline.walk_s(f, b, x, M) == pytest.approx(simulated_s(fwd, bwd, send, M), rel=1e-12), (S, M)


def test_walks_of_one_depth_made_together_equal_each_walk_to_the_bit() -> None:
    """`walks_s` walks pipelines of one depth together (one order for all: which input is ready never
    depends on the times); each row must be `walk_s` of that pipeline alone, bit for bit, and so must
    the tables `prime` makes with them (it walks together from WALKS_TOGETHER_FROM pipelines)."""
    rng = random.Random(5)
    for S in (2, 3, 7, 16, 23):
        pipes = [tuple(map(tuple, random_pipeline(rng, S, exact_stages=True)))
                 for _ in range(pipeline.WALKS_TOGETHER_FROM + 3)]
        f = np.array([p[0] for p in pipes])
        b = np.array([p[1] for p in pipes])
        x = np.array([(*p[2], 0.0) for p in pipes])
        for M in range(1, S + 2):
            together = pipeline.walks_s(f, b, x, M)
            for row in range(len(pipes)):
                assert together[row] == pipeline.walk_s(f[row], b[row], x[row], M), (S, M, row)
    deep = [tuple(map(tuple, random_pipeline(random.Random(seed), 12, exact_stages=True))) for seed in range(12)]
    most = pipeline.DEFAULT_MAX_MICRO
    alone = {p: pipeline.makespans_s(*p, most) for p in deep}
    pipeline._TABLES.clear()
    pipeline.prime(deep, most)
    for p, table in alone.items():
        assert np.array_equal(pipeline._TABLES[(*p, most, "1f1b")], table)


def test_tables_made_together_equal_those_made_one_by_one_to_the_bit() -> None:
    """`prime` runs the lattices of pipelines of one depth together (what the ILP's items ask for at once);
    each table must be the one `makespans_s` makes for that pipeline alone, bit for bit, and what
    pipeline_s then reads from it too."""
    rng = random.Random(11)
    pipes = [tuple(map(tuple, random_pipeline(rng, 20))) for _ in range(60)]
    pipes += [tuple(map(tuple, random_pipeline(random.Random(3), 20)))] * 2      # a pipeline asked twice
    most = pipeline.DEFAULT_MAX_MICRO
    alone = {p: pipeline.makespans_s(*p, most) for p in pipes}
    pipeline._TABLES.clear()
    pipeline.prime(pipes, most)
    assert len(pipeline._TABLES) == len({p for p in pipes if len(p[0]) > 1})       # one stage: no lattice
    for p in pipes:
        for M in {1, 2, max(1, len(p[0]) - 1), len(p[0]), 37, most}:
            assert pipeline.pipeline_s(*p, M) == alone[p][M], (p, M)
    for p, table in alone.items():
        if len(p[0]) > 1:
            assert np.array_equal(pipeline._TABLES[(*p, most, "1f1b")], table)
