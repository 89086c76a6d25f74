"""The search on synthetic cost tables: exact where it claims to be, sensible where it chooses."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from costmodel.network import ring_allreduce_s
from planner.core.cluster import Link
from planner.search import align, ilp, sync
from planner.search.configs import build_configs
from planner.search.enumerate import solve_exact
from planner.search.split import Lane, solve_shared_bounds, solve_split, stage_costs
from tests import synthetic as syn


def _brute_force_split(t, S, m, bw, lat, grads):
    N = len(t.fwd_s)
    best = None
    for cuts in itertools.combinations(range(1, N), S - 1):
        split = stage_costs(t, (0, *cuts, N), m, ((bw, lat),) * (S - 1), grads)
        if any(mem > t.capacity_bytes for mem in split.stage_memory_bytes):
            continue
        if best is None or split.max_stage_s < best.max_stage_s - 1e-12:
            best = split
    return best


@pytest.mark.parametrize("seed", range(12))
def test_split_is_optimal_against_enumeration(seed):
    rng = random.Random(seed)
    N = rng.randint(3, 9)
    t = syn.random_table(rng, "x", N, 4)
    grads = tuple([1e6] * N)
    for S in range(1, min(N, 4) + 1):
        got = solve_split(t, S, 2, ((1e10, 5e-6),) * (S - 1), grads)
        want = _brute_force_split(t, S, 2, 1e10, 5e-6, grads)
        if want is None:
            assert got is None
            continue
        assert got is not None and got.optimal
        # CP-SAT works in integer nanoseconds: equal up to that rounding
        assert got.max_stage_s == pytest.approx(want.max_stage_s, abs=N * 2e-9)


def test_split_respects_memory():
    t = syn.table("x", 1.0, blocks=6, devices=4, per_node=4, capacity_gib=10.0,
                  state_gib=[6, 1, 1, 1, 1, 6])
    assert solve_split(t, 1, 1, (), (0.0,) * 6) is None
    split = solve_split(t, 2, 1, ((1e10, 0.0),), (0.0,) * 6)
    assert split is not None and split.bounds == (0, 3, 6)
    assert max(split.stage_memory_bytes) <= t.capacity_bytes


def test_faster_class_gets_more_rows_per_device():
    fast = syn.table("fast", 3.0, blocks=4, devices=4, per_node=4)
    slow = syn.table("slow", 1.0, blocks=4, devices=4, per_node=4)
    tabs = syn.tables([fast, slow], 64, grad_gib=[0.001] * 4)
    sol = ilp.solve(tabs, build_configs(tabs, fixed_stages=1), use_all_devices=True)
    share = {c.config.cls: c.share for c in sol.choices}
    assert share[0] > share[1]
    assert sum(c.replicas * c.share for c in sol.choices) >= 64


def test_memory_forces_pipeline_depth():
    t = syn.table("x", 1.0, blocks=8, devices=8, per_node=8, capacity_gib=20.0, state_gib=[8.0] * 8)
    tabs = syn.tables([t], 16)
    configs = build_configs(tabs)
    assert min(c.num_stages for c in configs) >= 4   # 64 GiB of state over 20 GiB devices
    sol = ilp.solve(tabs, configs)
    assert all(c.config.num_stages >= 4 for c in sol.choices)


def test_expensive_sync_prefers_fewer_replicas():
    t = syn.table("x", 1.0, blocks=4, devices=8, per_node=1, block_s=[1e-4] * 4)
    cheap_sync = ilp.solve(syn.tables([t], 32, inter_gbit_s=10000, grad_gib=[0.0001] * 4),
                           build_configs(syn.tables([t], 32), fixed_stages=1))
    dear_sync = ilp.solve(syn.tables([t], 32, inter_gbit_s=1, grad_gib=[4.0] * 4),
                          build_configs(syn.tables([t], 32), fixed_stages=1))
    replicas = lambda s: sum(c.replicas for c in s.choices)  # noqa: E731
    assert replicas(dear_sync) < replicas(cheap_sync)


def test_solution_reports_optimality():
    t = syn.table("x", 1.0, blocks=4, devices=4, per_node=4)
    tabs = syn.tables([t], 8)
    sol = ilp.solve(tabs, build_configs(tabs))
    assert sol.status == "OPTIMAL" and sol.bound_s == pytest.approx(sol.objective_s)


# ---- aligned gradient groups across classes (planner.search.align) ------------------------------------
def _opposite_profiles(N: int = 6):
    """Two classes whose own best 2-stage splits differ: one is slow on early blocks, one on late."""
    early = syn.table("early", 1.0, blocks=N, devices=2, per_node=2, block_s=[3e-3] * 2 + [1e-3] * (N - 2))
    late = syn.table("late", 1.0, blocks=N, devices=2, per_node=2, block_s=[1e-3] * (N - 2) + [3e-3] * 2)
    return early, late


@pytest.mark.parametrize("seed", range(8))
def test_shared_split_is_optimal_against_enumeration(seed):
    rng = random.Random(100 + seed)
    N = rng.randint(3, 8)
    tabs = [syn.random_table(rng, f"c{i}", N, 4) for i in range(rng.choice([2, 3]))]
    S = rng.randint(1, min(N, 4))
    own = [solve_split(t, S, 2, ((1e10, 5e-6),) * (S - 1), (1e6,) * N) for t in tabs]
    if any(o is None for o in own):
        return
    lanes = [Lane(t, ((1e10, 5e-6),) * (S - 1), False, o.max_stage_s) for t, o in zip(tabs, own)]
    got = solve_shared_bounds(lanes, S, 2)

    def worst(bounds):
        splits = [stage_costs(t, bounds, 2, ((1e10, 5e-6),) * (S - 1), (1e6,) * N) for t in tabs]
        if any(m > t.capacity_bytes for t, s in zip(tabs, splits) for m in s.stage_memory_bytes):
            return None
        return max(s.max_stage_s / o.max_stage_s for s, o in zip(splits, own))

    candidates = [w for cuts in itertools.combinations(range(1, N), S - 1)
                  if (w := worst((0, *cuts, N))) is not None]
    if not candidates:
        assert got is None
        return
    assert got is not None and worst(got) == pytest.approx(min(candidates), rel=1e-9)


def test_replicas_on_different_classes_keep_nested_cuts():
    early, late = _opposite_profiles()
    tabs = syn.tables([early, late], 16, grad_gib=[0.5] * 6)
    own = {ci: solve_split(t, 2, 1, ((t.intra_bandwidth_bytes_s, t.intra_latency_s),), tabs.grad_bytes).bounds
           for ci, t in enumerate(tabs.classes)}
    assert own[0] != own[1]                    # each class alone would cut elsewhere
    sol = ilp.solve(tabs, build_configs(tabs, fixed_stages=2), use_all_devices=True)
    bounds = {c.config.split.bounds for c in sol.choices}
    assert {ci for c in sol.choices for ci in c.config.classes} == {0, 1}
    assert all(align.nested(a, b) for a in bounds for b in bounds)
    assert len(bounds) == 1                    # same stage count: the same cuts


def test_nested_cuts():
    assert align.nested((0, 2, 4), (0, 1, 2, 3, 4))
    assert align.nested((0, 4), (0, 2, 4))
    assert not align.nested((0, 2, 4), (0, 3, 4))
    assert align.conflicts([(0, 2, 4), (0, 3, 4), (0, 4)]) == [(0, 1)]


def test_tied_weights_add_a_collective_on_each_holder():
    # 4 blocks of 1 GiB gradients each; a 0.25 GiB parameter read by blocks 0 and 3 (counted in both)
    tabs = dataclasses.replace(syn.tables([syn.table("x", 1.0, blocks=4, devices=4, per_node=4)], 8,
                                          grad_gib=[4.0] * 4), tied=(((0, 3), 0.25 * syn.GIB),))
    one_stage = sync.stage_sync_parts(tabs, (0, 4))
    assert one_stage == [(4 * syn.GIB - 0.25 * syn.GIB, [])]          # one holder: in its own group once
    two = sync.stage_sync_parts(tabs, (0, 2, 4))
    assert two == [(1.75 * syn.GIB, [(0.25 * syn.GIB, 2)])] * 2
    link = Link("inter", 10e9, 1e-3)
    got = sync.split_sync_s(tabs, 0, (0, 2, 4), [4], link)
    want = ring_allreduce_s(1.75 * syn.GIB, 4, link) + ring_allreduce_s(0.25 * syn.GIB, 8, link)
    assert got == [pytest.approx(want)]


def test_sync_of_a_later_stage_overlaps_the_drain_of_earlier_ones():
    # stage 1 has 3x the gradient bytes of stage 0 but finishes its last backward while stage 0 runs its own
    t = syn.table("x", 1.0, blocks=4, devices=4, per_node=4, block_s=[3e-3] * 4, overhead_s=0.0)
    tabs = syn.tables([t], 8, grad_gib=[0.5, 0.5, 1.5, 1.5])
    link = Link("inter", 10e9, 1e-5)
    overlap = sync.drain_overlap_s(tabs, (0, 0), (0, 2, 4), micro_batch=2)
    assert overlap == [0.0, pytest.approx(2 * 2 * 2e-3)]       # two blocks of stage 0, backward 2 ms each
    s0 = ring_allreduce_s(1.0 * syn.GIB / 4, 4, link)
    s1 = ring_allreduce_s(3.0 * syn.GIB / 4, 4, link)
    assert sync.split_sync_s(tabs, 0, (0, 2, 4), [4], link, overlap) == [pytest.approx(max(s0, s1 - overlap[1]))]
    assert sync.split_sync_s(tabs, 0, (0, 2, 4), [4], link) == [pytest.approx(s1)]


def test_a_model_too_deep_for_either_class_gets_one_pipeline_across_both():
    # four 30 GiB blocks, 40 GiB devices: four stages needed, and each class has two devices
    a = syn.table("a", 2.0, blocks=4, devices=2, per_node=2, state_gib=[30.0] * 4)
    b = syn.table("b", 1.0, blocks=4, devices=2, per_node=2, state_gib=[30.0] * 4)
    tabs = syn.tables([a, b], 8)
    configs = build_configs(tabs)
    assert configs and all(c.stage_classes for c in configs)      # no single-class pipeline fits
    sol = ilp.solve(tabs, configs)
    [choice] = sol.choices
    assert sorted(choice.config.classes) == [0, 0, 1, 1] and choice.replicas == 1 and choice.share == 8
    exact = solve_exact(tabs, configs)
    assert sol.objective_s == pytest.approx(exact.objective_s, abs=1e-9)
