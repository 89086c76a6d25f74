"""The degree search (planner.search.degrees): the ILP within 1% of the exact enumerator over the
tensor-parallel degree and ZeRO decisions, on random tables with random shardings; and instances built
so that TP, or ZeRO, is what wins."""

from __future__ import annotations

import random

import pytest

from costmodel.tables import CostTables
from planner.search import degrees
from planner.search.options import SearchOptions
from tests import synthetic as syn
from tests import synthetic_tp as syn_tp

SEEDS = range(24)
MIN_FEASIBLE = 16
MIN_TP_WINS = 3          # seeds whose optimum is at a degree above 1: the TP decision is exercised
NS_S = 1e-9              # both sides work in integer nanoseconds
TOLERANCE = 0.01         # the ILP must be within 1% of the optimum
ILP = SearchOptions(strategy="ilp")
EXACT = SearchOptions(strategy="exact")


def instance(seed: int) -> CostTables:
    """1-2 classes of one or two nodes of 4 or 8 devices (at most 8 devices), 2-6 blocks, random shardings."""
    rng = random.Random(seed)
    shapes = rng.choice([((8, 8),), ((4, 4), (4, 4)), ((8, 4),), ((4, 4),)])    # (devices, per_node) per class
    N = rng.randint(2, 6)
    heavy = rng.random() < 0.5
    classes = [syn.table(
        f"c{ci}", rng.choice([1.0, 1.5, 2.0, 3.0]), blocks=N, devices=devices, per_node=per_node,
        block_s=[rng.uniform(0.2e-3, 3e-3) for _ in range(N)],
        state_gib=[rng.uniform(2.0, 16.0) if heavy else rng.uniform(0.05, 2.0) for _ in range(N)],
        capacity_gib=rng.choice([16.0, 24.0, 40.0]), boundary_bytes=rng.uniform(1e5, 1e7),
        act_gib=rng.choice([0.0, 0.01, 0.05]), intra_gbyte_s=rng.choice([50.0, 300.0]))
        for ci, (devices, per_node) in enumerate(shapes)]
    tabs = syn.tables(classes, rng.choice([1, 2, 4, 8, 16]), inter_gbit_s=rng.choice([1.0, 10.0, 100.0]),
                      grad_gib=[rng.uniform(0.05, 2.0) for _ in range(N)])
    return syn_tp.with_shardings(tabs, syn_tp.random_shardings(rng, tabs))


def _best(tabs: CostTables, options: SearchOptions) -> tuple[float, degrees.Variant] | None:
    found = degrees.best(tabs, options)
    return (found[0][0].objective_s, found[0][1]) if found else None


@pytest.fixture(scope="module")
def solved() -> dict[int, tuple[tuple[float, degrees.Variant] | None, tuple[float, degrees.Variant] | None]]:
    return {seed: (_best(instance(seed), ILP), _best(instance(seed), EXACT)) for seed in SEEDS}


@pytest.mark.parametrize("seed", SEEDS)
def test_ilp_matches_exact_over_degrees_and_zero(seed, solved):
    ilp, exact = solved[seed]
    assert (ilp is None) == (exact is None)
    if exact is None:
        return
    assert ilp[0] >= exact[0] - NS_S, "the ILP claims better than the optimum"
    assert ilp[0] <= exact[0] * (1 + TOLERANCE)


def test_instances_exercise_the_degree_decision(solved):
    feasible = [exact for _, exact in solved.values() if exact is not None]
    assert len(feasible) >= MIN_FEASIBLE
    assert sum(1 for _, v in feasible if v.tp_degree > 1) >= MIN_TP_WINS
    assert sum(1 for _, v in feasible if v.tp_degree == 1) >= MIN_TP_WINS


# ---- instances where one decision wins ---------------------------------------------------------------
def _tp_wins() -> CostTables:
    """One node of 8, two samples per iteration: a pipeline cannot fill and data parallelism has two
    replicas, while TP=8 splits 95% of the FLOPs over NVLink-class links."""
    N = 8
    t = syn.table("g", 1.0, blocks=N, devices=8, per_node=8, block_s=[2e-3] * N, state_gib=[2.0] * N,
                  capacity_gib=40.0, intra_gbyte_s=300.0)
    tabs = syn.tables([t], 2, inter_gbit_s=100.0, grad_gib=[0.5] * N)
    return syn_tp.with_shardings(tabs, [syn_tp.sharding(g, flops_fraction=0.95, allreduce_bytes=1e5)
                                        for g in tabs.grad_bytes])


def _zero_wins() -> CostTables:
    """Two nodes of 8, 24 GiB of state per block on 40 GiB devices: without ZeRO one block per stage
    (4 stages, 4 replicas of 4 samples); with the moments over 8 replicas two blocks fit a stage
    (2 stages, 8 replicas of 2 samples): a shorter pipeline. No pairs: degree 1 only."""
    N = 4
    t = syn.table("g", 1.0, blocks=N, devices=16, per_node=8, block_s=[2e-3] * N, state_gib=[24.0] * N,
                  capacity_gib=40.0, intra_gbyte_s=300.0)
    return syn.tables([t], 16, inter_gbit_s=400.0, grad_gib=[0.05] * N)


@pytest.mark.parametrize("strategy", ["ilp", "exact"])
def test_tp_is_chosen_where_it_wins(strategy):
    tabs = _tp_wins()
    objective, variant = _best(tabs, SearchOptions(strategy=strategy))
    forced_1 = _best(tabs, SearchOptions(strategy=strategy, tp=1))
    assert variant.tp_degree > 1
    assert forced_1 is not None and objective < forced_1[0] / 2     # TP at least twice as fast here


@pytest.mark.parametrize("strategy", ["ilp", "exact"])
def test_zero_is_chosen_where_memory_is_short(strategy):
    tabs = _zero_wins()
    objective, variant = _best(tabs, SearchOptions(strategy=strategy))
    without = _best(tabs, SearchOptions(strategy=strategy, zero="off"))
    assert variant.zero_group == 8 and variant.tp_degree == 1
    assert without is not None and objective < without[0]
    assert sum(c.replicas for c in degrees.best(tabs, SearchOptions(strategy=strategy))[0][0].choices) >= 8


def test_zero_is_not_offered_where_the_model_fits_one_device():
    t = syn.table("g", 1.0, blocks=4, devices=16, per_node=8, state_gib=[1.0] * 4)
    assert {v.zero_group for v in degrees.variants(syn.tables([t], 16), ILP)} == {1}


@pytest.mark.parametrize("seed", range(0, 24, 3))
def test_compute_bound_is_below_every_variants_optimum(seed):
    """The bound `search` prunes by never exceeds what a variant reaches: pruning keeps the optimum."""
    tabs = instance(seed)
    for variant in degrees.variants(tabs, EXACT):
        for solution in degrees.solve(variant, EXACT):
            assert degrees.compute_bound_s(variant.tables) <= solution.objective_s + NS_S


def test_pruning_keeps_the_plan_the_full_search_finds():
    for seed in range(8):
        tabs = instance(seed)
        full = sorted((s.objective_s, v.tp_degree, v.zero_group) for v in degrees.variants(tabs, ILP)
                       for s in degrees.solve(v, ILP))
        found, records = degrees.search(tabs, ILP)
        assert (found[0][0].objective_s, found[0][1].tp_degree, found[0][1].zero_group) == pytest.approx(full[0])
        assert len(records) == len(degrees.variant_tables(tabs, ILP))


def test_zero_variant_that_cannot_have_its_group_is_skipped():
    """96 devices of 40 GiB, 32 blocks of 24 GiB (13.5 with the moments over 8): at least 16 stages even
    so, at most 6 replicas: ZeRO's group of 8 cannot form, and its configurations are never built."""
    N = 32
    t = syn.table("g", 1.0, blocks=N, devices=96, per_node=8, state_gib=[24.0] * N, capacity_gib=40.0)
    tabs = syn.tables([t], 96)
    assert degrees.most_replicas(_built(tabs, 8)[0], ILP) < 8
    found, records = degrees.search(tabs, ILP)
    skipped = [r for r in records if r["zero_group"] == 8]
    assert skipped and all("pruned" in r and r["configurations"] == 0 for r in skipped)
    assert found and all(v.zero_group == 1 for _, v in found)
    assert degrees.solve(degrees.Variant(1, 8, *_built(tabs, 8)), ILP) == []     # the search would find none


def _built(tabs: CostTables, z: int) -> tuple[CostTables, list]:
    from costmodel import sharded_state
    from planner.search.configs import build_configs
    at = sharded_state.at_group(tabs, z)
    return at, build_configs(at)


def test_variants_are_taken_likeliest_winner_first():
    """Where the model fits a device whole the lowest degree is solved first (TP's collectives rarely pay),
    where memory is short the middle degree, then outwards (higher first), ZeRO first: the order the
    records keep."""
    fits = syn.tables([syn.table("g", 1.0, blocks=4, devices=16, per_node=8, state_gib=[1.0] * 4,
                                 capacity_gib=40.0)], 16)
    short = _zero_wins()
    for tabs, expect_short in ((fits, False), (short, True)):
        assert degrees.memory_short(tabs) is expect_short
        order = [(r["tp_degree"], r["zero_group"]) for r in degrees.search(syn_tp.with_shardings(
            tabs, syn_tp.random_shardings(random.Random(0), tabs)), ILP)[1]]
        assert len(order) > 1
        offered = sorted({t for t, _ in order})
        mid = len(offered) // 2
        place = {t: (abs(i - mid), -i) for i, t in enumerate(offered)}    # [1, 2, 4] -> 2, 4, 1
        expected = sorted(order, key=lambda tz: (place[tz[0]], -tz[1]) if expect_short else tz)
        assert order == expected
        if expect_short:
            assert order[0][0] == offered[mid] and order[0][1] == max(z for _, z in order)


def test_middle_out_starts_in_the_middle_and_goes_out_higher_side_first():
    assert degrees.middle_out([1, 2, 4, 8]) == {4: 0, 8: 1, 2: 2, 1: 3}
    assert degrees.middle_out([1, 2, 4]) == {2: 0, 4: 1, 1: 2}
    assert degrees.middle_out([1, 2]) == {2: 0, 1: 1}
    assert degrees.middle_out([1]) == {1: 0}
