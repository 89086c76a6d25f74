"""The ILP against exact enumeration of its own decision space, on small random instances."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from costmodel.tables import CostTables
from planner.api import PlanOptions, plan
from planner.core.cluster import Link
from planner.search import align, candidates, ilp
from planner.search.configs import build_configs, overlap_of
from planner.search.enumerate import all_items, solve_exact, to_ns
from planner.search.solver import SolverSettings
from planner.search.sync import split_sync_s
from tests import synthetic as syn
from tests.helpers import CLUSTERS, EXAMPLES

SEEDS = range(64)
MIN_FEASIBLE = 50
NS_S = 1e-9          # both sides work in integer nanoseconds
TOLERANCE = 0.01     # the ILP must be within 1% of the optimum


def instance(seed: int) -> CostTables:
    """2-3 device classes, at most 6 devices and 8 blocks; heavy or light models, cheap or dear sync."""
    rng = random.Random(seed)
    n_classes = rng.choice([2, 3])
    counts = [1] * n_classes
    for _ in range(rng.randint(n_classes, 6) - n_classes):
        counts[rng.randrange(n_classes)] += 1
    N = rng.randint(2, 8)
    heavy = rng.random() < 0.5
    classes = []
    for ci, devices in enumerate(counts):
        per_node = rng.choice([p for p in (1, 2, 3, 4, 6) if devices % p == 0])
        classes.append(syn.table(
            f"c{ci}", rng.choice([1.0, 1.5, 2.0, 3.0]), blocks=N, devices=devices, per_node=per_node,
            block_s=[rng.uniform(0.2e-3, 3e-3) for _ in range(N)],
            state_gib=[rng.uniform(0.5, 8.0) if heavy else rng.uniform(0.05, 2.0) for _ in range(N)],
            capacity_gib=rng.choice([16.0, 24.0, 40.0]), boundary_bytes=rng.uniform(1e5, 1e7),
            act_gib=rng.choice([0.0, 0.01, 0.05]), intra_gbyte_s=rng.choice([10.0, 100.0])))
    tabs = syn.tables(classes, rng.choice([4, 8, 16, 32, 64]), inter_gbit_s=rng.choice([1.0, 10.0, 100.0]),
                      grad_gib=[rng.uniform(0.01, 2.0) for _ in range(N)])
    # every other instance knows its blocks' weight gradients, so its pipelines are offered under ZB-H1
    # too (drawn apart: the instances above are the ones the tests were written on)
    split = random.Random(1000 + seed)
    if seed % 2:
        tabs = dataclasses.replace(tabs, wgrad_fraction=tuple(split.uniform(0.0, 0.6) for _ in range(N)))
    return tabs


@pytest.mark.parametrize("seed", SEEDS)
def test_ilp_matches_exact_enumeration(seed):
    tabs = instance(seed)
    configs = build_configs(tabs) + build_configs(tabs, schedule="zbh1")     # ZB-H1 beside the rest
    exact = solve_exact(tabs, configs) if configs else None
    sol = ilp.solve(tabs, configs) if configs else None
    assert (exact is None) == (sol is None)
    if exact is None:
        return
    assert sol.objective_s >= exact.objective_s - NS_S, "the ILP claims better than the optimum"
    assert sol.objective_s <= exact.objective_s * (1 + TOLERANCE)
    assert sum(c.replicas * c.share for c in exact.choices) >= tabs.global_batch


def test_enough_instances_are_feasible():
    feasible = sum(1 for seed in SEEDS if build_configs(instance(seed)))
    assert feasible >= MIN_FEASIBLE


# Seeds 0 and 20 caught CP-SAT 9.15's presolve certifying a wrong optimum (google/or-tools#5293);
# ilp.solve_regime turns that presolve step off.
@pytest.mark.parametrize("seed", range(0, 64, 4))
def test_ilp_matches_exact_enumeration_with_all_devices(seed):
    tabs = instance(seed)
    configs = build_configs(tabs)
    exact = solve_exact(tabs, configs, use_all_devices=True) if configs else None
    sol = ilp.solve(tabs, configs, use_all_devices=True) if configs else None
    assert (exact is None) == (sol is None)
    if exact is not None:
        assert exact.objective_s - NS_S <= sol.objective_s <= exact.objective_s * (1 + TOLERANCE)


# ---- the enumeration's reduction against literal multisets of items ---------------------------------
def _brute_force_ns(tabs: CostTables, configs: list[candidates.Config]) -> int | None:
    """Every multiset of items per class within its devices whose splits have nested cuts; the ILP's
    objective, both regimes."""
    items = all_items(tabs, configs)
    grid = ilp.replica_grid(sum(t.num_devices for t in tabs.classes))
    inter = Link("inter", tabs.inter_bandwidth_bytes_s, tabs.inter_latency_s)
    budget = [t.num_devices for t in tabs.classes]

    def fits(multiset) -> bool:
        return all(sum(configs[it.config].devices_of(ci) for it in multiset) <= budget[ci]
                   for ci in range(len(budget)))

    best = None
    for r in range(1, sum(budget) + 1):
        for used in itertools.combinations_with_replacement(items, r):
            if sum(it.capacity for it in used) < tabs.global_batch or not fits(used):
                continue
            splits = {configs[it.config].split.bounds for it in used}
            if any(not align.nested(a, b) for a in splits for b in splits):
                continue
            split_of = {configs[it.config].shape: configs[it.config].split.bounds for it in used}
            grid_R = next(g for g in grid if g >= r)
            pipe = max(it.time_ns for it in used)
            for one_node in (False, True):
                if one_node:
                    classes = {ci for shape in split_of for ci in shape if ci >= 0}
                    if len(classes) > 1 or sum(candidates.shape_devices(configs[it.config].shape) for it in used) > \
                            tabs.classes[next(iter(classes))].per_node:
                        continue

                def link(ci: int, one_node: bool = one_node) -> Link:
                    t = tabs.classes[ci]
                    return Link("intra", t.intra_bandwidth_bytes_s, t.intra_latency_s) if one_node else inter
                sync = max(to_ns(split_sync_s(tabs, s[0], b, [grid_R], link(s[0]), overlap_of(tabs, configs, s, b),
                                              chunks=candidates.shape_chunks(s))[0]) for s, b in split_of.items())
                if best is None or pipe + sync < best:
                    best = pipe + sync
    return best


@pytest.mark.parametrize("seed", range(8))
def test_enumeration_equals_literal_multisets(seed):
    rng = random.Random(1000 + seed)
    N = rng.randint(2, 4)
    classes = [syn.table(f"c{ci}", rng.choice([1.0, 2.0, 3.0]), blocks=N, devices=d, per_node=rng.choice([1, d]),
                         block_s=[rng.uniform(0.2e-3, 3e-3) for _ in range(N)],
                         state_gib=[rng.uniform(0.05, 2.0) for _ in range(N)])
               for ci, d in enumerate(rng.choice([(1, 2), (2, 1), (1, 1, 1), (2, 2)]))]
    tabs = syn.tables(classes, rng.choice([3, 4, 6]), inter_gbit_s=rng.choice([1.0, 100.0]),
                      grad_gib=[rng.uniform(0.01, 1.0) for _ in range(N)])
    configs = build_configs(tabs)
    exact = solve_exact(tabs, configs)
    assert exact is not None
    assert to_ns(exact.objective_s) == _brute_force_ns(tabs, configs)


# ---- what the enumerator shows about the ILP's model -------------------------------------------------
ONE_NODE_OVERFLOW_SEED = 72    # an instance() whose one-node optimum overfills a node


def test_one_node_regime_fits_the_whole_class_in_one_node():
    """Once charged intra-node sync for a layout no node could hold (seed 72); the bound is per class."""
    tabs = instance(ONE_NODE_OVERFLOW_SEED)
    configs = build_configs(tabs)
    items = ilp.pareto_items(tabs, configs)
    sol = ilp.solve_regime(tabs, configs, items, True, SolverSettings(work_limit_s=10.0))
    assert sol is not None
    for ci, table in enumerate(tabs.classes):
        devices = sum(c.replicas * len(c.config.device_classes) for c in sol.choices if c.config.cls == ci)
        assert devices <= table.per_node
    assert ilp.solve(tabs, configs).objective_s == pytest.approx(solve_exact(tabs, configs).objective_s,
                                                                 rel=TOLERANCE)


def test_exact_strategy_plans_a_real_model_as_the_ilp_does():
    def objective(strategy: str) -> float:
        result = plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / "cpu-hetero-4.yaml",
                      PlanOptions(global_batch=32, strategy=strategy))
        return result.plan.solver.objective_s

    assert objective("exact") == pytest.approx(objective("ilp"), abs=NS_S)
