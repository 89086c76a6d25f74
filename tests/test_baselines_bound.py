"""The baselines' pruning: layout_bound_s never exceeds an estimate, so the strategies skip only
depths and micro-batch sizes that could not be chosen: every baseline picks what it picks unpruned."""

from __future__ import annotations

import random

import pytest

from planner.search import baselines
from planner.search.options import SearchOptions
from tests import synthetic as syn

SEEDS = (0, 1, 5, 6, 7, 9)     # clusters where some layout fits, one to three device classes


def _random_tables(seed: int):
    rng = random.Random(seed)
    classes = [syn.random_table(rng, f"c{ci}", 12, rng.choice([4, 8])) for ci in range(rng.randint(1, 3))]
    return syn.tables(classes, rng.choice([8, 32, 64]))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_bound_is_below_every_layouts_estimate(seed):
    tabs = _random_tables(seed)
    everyone = list(range(len(tabs.classes)))
    layouts = (baselines._metis_layout(tabs), baselines._even_layout(tabs, everyone, balanced=False, strict=False))
    checked = 0
    for S in baselines._depths(tabs, everyone, SearchOptions()):
        for m in baselines._micro_batches(tabs, SearchOptions()):
            bound = baselines.layout_bound_s(tabs, everyone, S, m)
            for layout in layouts:
                replicas = layout(S, m)
                if replicas:
                    assert bound <= baselines.evaluate(tabs, replicas).objective_s * (1 + 1e-12), (S, m)
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_pruning_keeps_every_choice(seed):
    tabs = _random_tables(seed)
    everyone = list(range(len(tabs.classes)))
    depths = baselines._depths(tabs, everyone, SearchOptions())
    micros = baselines._micro_batches(tabs, SearchOptions())
    for layout, first_fit in ((baselines._metis_layout(tabs), False),
                              (baselines._even_layout(tabs, everyone, balanced=True), False),
                              (baselines._even_layout(tabs, everyone, balanced=False, strict=False), True)):
        pruned = baselines._best(tabs, layout, depths, micros, first_fit, classes=everyone)
        every = baselines._best(tabs, layout, depths, micros, first_fit)
        assert pruned == every


def test_a_depth_no_pipeline_can_take_is_unbounded():
    t = syn.table("x", 1.0, blocks=8, devices=4, per_node=4)
    tabs = syn.tables([t], 8)
    assert baselines.layout_bound_s(tabs, [0], 8, 1) == float("inf")     # 8 stages on 4 devices
    assert baselines.layout_bound_s(tabs, [0], 2, 1) < float("inf")


def test_the_bound_skips_layouts_that_cannot_win():
    tabs = _random_tables(0)
    everyone = list(range(len(tabs.classes)))
    depths = baselines._depths(tabs, everyone, SearchOptions())
    micros = baselines._micro_batches(tabs, SearchOptions())
    built: list[tuple[int, int]] = []
    metis = baselines._metis_layout(tabs)

    def counted(S: int, m: int):
        built.append((S, m))
        return metis(S, m)

    baselines._best(tabs, counted, depths, micros, classes=everyone)
    pruned = len(built)
    built.clear()
    baselines._best(tabs, counted, depths, micros)
    assert pruned < len(built) == len(depths) * len(micros)
