"""The two-step solve of a regime (planner.search.ilp.solve_bounded): the coarse frontier's plan bounds
the full model, which then drops every item slower than it. On random heterogeneous instances at batches
of 128 and 256 (large enough for the coarse frontier to drop items, small enough to solve whole in CI), it
reaches the optimum of the full model solved whole, in both regimes and under a cutoff, with and without a
least replica count (ZeRO's group), where each item is also dropped when its time plus the least sync its
group can be charged exceeds the bound (ilp.ItemSyncs.least_ns)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner.search import ilp
from planner.search.configs import build_configs
from planner.search.solver import DEFAULT_SETTINGS
from tests import test_enumerate

NS_S = 1e-9
SEEDS = range(24)


def _instance(seed: int):
    tabs = dataclasses.replace(test_enumerate.instance(seed), global_batch=random.Random(seed).choice([128, 256]))
    return tabs, build_configs(tabs)


@pytest.mark.parametrize(("seed", "least"), [(seed, 1) for seed in SEEDS] + [(seed, 4) for seed in SEEDS[1::6]])
def test_the_bounded_solve_reaches_the_whole_models_optimum(seed, least):
    tabs, configs = _instance(seed)
    if not configs:
        return
    items = ilp.pareto_items(tabs, configs)
    for one_node in (False, True):
        whole = ilp.solve_regime(tabs, configs, items, one_node, DEFAULT_SETTINGS, min_replicas=least)
        bounded = ilp.solve_bounded(tabs, configs, items, one_node, DEFAULT_SETTINGS, min_replicas=least)
        assert (whole is None) == (bounded is None)
        if whole is None:
            continue
        assert abs(bounded.objective_s - whole.objective_s) <= NS_S, (seed, one_node)
        assert bounded.status == whole.status == "OPTIMAL"
        assert bounded.configurations == len(items)
        # under a cutoff just above the optimum it is found; just below it, none is
        cut = ilp.to_ns(bounded.objective_s)
        assert ilp.solve_bounded(tabs, configs, items, one_node, DEFAULT_SETTINGS, min_replicas=least,
                                 cutoff_ns=cut) is not None
        below = ilp.solve_bounded(tabs, configs, items, one_node, DEFAULT_SETTINGS, min_replicas=least,
                                  cutoff_ns=cut - 1000)
        assert below is None


def test_the_least_sync_drops_items_the_time_alone_keeps():
    """Not vacuous: under a cutoff at the optimum, with a least replica count, the items' least sync drops
    items whose time alone is within it, on most instances."""
    dropped, tried = 0, 0
    for seed in SEEDS[1::4]:
        tabs, configs = _instance(seed)
        if not configs:
            continue
        items = ilp.pareto_items(tabs, configs)
        best = ilp.solve_regime(tabs, configs, items, False, DEFAULT_SETTINGS, min_replicas=4)
        if best is None:
            continue
        tried += 1
        cut = ilp.to_ns(best.objective_s)
        least = ilp.ItemSyncs.of(tabs, configs, items, False).least_ns(4)
        dropped += any(i.time_ns <= cut < i.time_ns + sync for i, sync in zip(items, least))
    assert tried >= 4 and dropped >= tried // 2, (dropped, tried)


def test_the_coarse_step_is_taken_on_most_instances():
    """Not vacuous: on most instances the coarse frontier holds at most half the items, so the bound is used."""
    taken = 0
    for seed in SEEDS:
        tabs, configs = _instance(seed)
        if configs:
            items = ilp.pareto_items(tabs, configs)
            taken += 2 * len(ilp.frontier(items, configs, ilp.COARSE_STEP_FRACTION)) <= len(items)
    assert taken >= len(SEEDS) // 2, taken


@pytest.mark.parametrize("seed", SEEDS[2::4])
def test_one_shape_repeated_is_a_plan_of_the_model_that_bounds_its_optimum(seed):
    """ilp.single_shape_ns is the objective of a plan the model holds: under it as a cutoff the model finds
    a plan, and its optimum is never above it; in both regimes, with and without a least replica count."""
    tabs, configs = _instance(seed)
    if not configs:
        return
    items = ilp.pareto_items(tabs, configs)
    for one_node in (False, True):
        for least in (1, 4):
            alone = ilp.single_shape_ns(tabs, configs, items, ilp.ItemSyncs.of(tabs, configs, items, one_node),
                                        one_node, least)
            whole = ilp.solve_regime(tabs, configs, items, one_node, DEFAULT_SETTINGS, min_replicas=least)
            if alone is None:
                continue
            assert whole is not None and whole.objective_s <= alone * NS_S + NS_S, (seed, one_node, least)
            assert ilp.solve_regime(tabs, configs, items, one_node, DEFAULT_SETTINGS, min_replicas=least,
                                    cutoff_ns=alone) is not None


def test_one_shape_repeated_is_near_the_optimum_on_most_instances():
    """Not vacuous: the bound it gives the first solve is within 1.5x of the optimum on most instances."""
    near, tried = 0, 0
    for seed in SEEDS[::3]:
        tabs, configs = _instance(seed)
        if not configs:
            continue
        items = ilp.pareto_items(tabs, configs)
        alone = ilp.single_shape_ns(tabs, configs, items, ilp.ItemSyncs.of(tabs, configs, items, False), False, 1)
        best = ilp.solve_bounded(tabs, configs, items, False, DEFAULT_SETTINGS)   # the whole model's optimum
        if alone is None or best is None:
            continue
        tried += 1
        near += alone * NS_S <= 1.5 * best.objective_s
    assert tried >= 5 and near >= tried * 0.6, (near, tried)
