"""The search on synthetic cost tables: exact where it claims to be, sensible where it chooses."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.search import ilp
from planner.search.split import solve_split, stage_costs
from tests import synthetic as syn


def _brute_force_split(t, S, m, bw, lat, grads):
    N = len(t.fwd_s)
    best = None
    for cuts in itertools.combinations(range(1, N), S - 1):
        split = stage_costs(t, (0, *cuts, N), m, bw, lat, grads)
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
        got = solve_split(t, S, 2, 1e10, 5e-6, grads)
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
    assert solve_split(t, 1, 1, 1e10, 0, (0.0,) * 6) is None
    split = solve_split(t, 2, 1, 1e10, 0, (0.0,) * 6)
    assert split is not None and split.bounds == (0, 3, 6)
    assert max(split.stage_memory_bytes) <= t.capacity_bytes


def test_faster_class_gets_more_rows_per_device():
    fast = syn.table("fast", 3.0, blocks=4, devices=4, per_node=4)
    slow = syn.table("slow", 1.0, blocks=4, devices=4, per_node=4)
    tabs = syn.tables([fast, slow], 64, grad_gib=[0.001] * 4)
    sol = ilp.solve(tabs, ilp.build_configs(tabs, fixed_stages=1), use_all_devices=True)
    share = {c.config.cls: c.share for c in sol.choices}
    assert share[0] > share[1]
    assert sum(c.replicas * c.share for c in sol.choices) >= 64


def test_memory_forces_pipeline_depth():
    t = syn.table("x", 1.0, blocks=8, devices=8, per_node=8, capacity_gib=20.0, state_gib=[8.0] * 8)
    tabs = syn.tables([t], 16)
    configs = ilp.build_configs(tabs)
    assert min(c.num_stages for c in configs) >= 4   # 64 GiB of state over 20 GiB devices
    sol = ilp.solve(tabs, configs)
    assert all(c.config.num_stages >= 4 for c in sol.choices)


def test_expensive_sync_prefers_fewer_replicas():
    t = syn.table("x", 1.0, blocks=4, devices=8, per_node=1, block_s=[1e-4] * 4)
    cheap_sync = ilp.solve(syn.tables([t], 32, inter_gbit_s=10000, grad_gib=[0.0001] * 4),
                           ilp.build_configs(syn.tables([t], 32), fixed_stages=1))
    dear_sync = ilp.solve(syn.tables([t], 32, inter_gbit_s=1, grad_gib=[4.0] * 4),
                          ilp.build_configs(syn.tables([t], 32), fixed_stages=1))
    replicas = lambda s: sum(c.replicas for c in s.choices)  # noqa: E731
    assert replicas(dear_sync) < replicas(cheap_sync)


def test_solution_reports_optimality():
    t = syn.table("x", 1.0, blocks=4, devices=4, per_node=4)
    tabs = syn.tables([t], 8)
    sol = ilp.solve(tabs, ilp.build_configs(tabs))
    assert sol.status == "OPTIMAL" and sol.bound_s == pytest.approx(sol.objective_s)
