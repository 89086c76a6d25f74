"""A replica whose share is below the micro-batch size runs one micro-batch of its share's rows
(assemble._micro_sizes), and the plan's estimate prices it at those rows, not at a whole micro-batch as
the search's items do (planner.search.assemble)."""

from __future__ import annotations

import pytest

from planner.search import assemble
from planner.search.configs import build_configs
from tests import synthetic as syn

MICRO = 16


def _config_and_tables():
    # overhead-bound blocks, as on CPU: a micro-batch's launches cost as much as 16 rows of work
    t = syn.table("c", 1.0, blocks=4, devices=4, per_node=4, block_s=[1e-3] * 4, overhead_s=8e-3)
    tabs = syn.tables([t], 64)
    config = next(c for c in build_configs(tabs, 2, MICRO) if c.num_stages == 2 and c.schedule == "1f1b")
    return config, tabs


def test_at_the_micro_batch_size_the_stage_times_are_the_configurations():
    config, tabs = _config_and_tables()
    same = assemble.at_rows(config, tabs, MICRO)
    assert same.split.fwd_s == pytest.approx(config.split.fwd_s, rel=1e-12)
    assert same.split.bwd_s == pytest.approx(config.split.bwd_s, rel=1e-12)


def test_a_share_below_the_micro_batch_is_priced_at_its_rows():
    config, tabs = _config_and_tables()
    table = tabs.classes[0]
    one = assemble._Replica(config, 1, [])
    whole = config.replica_time_s(1)
    # each stage: 1 row of work plus the stage's launches, split evenly between forward and backward
    lo, hi = config.split.bounds[0], config.split.bounds[1]
    fwd = sum(table.fwd_s[lo:hi]) + 0.5 * sum(table.overhead_s[lo:hi])
    assert assemble.at_rows(config, tabs, 1).split.fwd_s[0] == pytest.approx(fwd, rel=1e-12)
    assert one.estimated_s(tabs) == pytest.approx(assemble.at_rows(config, tabs, 1).replica_time_s(1), rel=1e-12)
    assert one.estimated_s(tabs) < whole
    # 15 rows of work fewer, on each of the two stages, forward and backward
    saved = (MICRO - 1) * sum(f + b for f, b in zip(table.fwd_s, table.bwd_s))
    assert whole - one.estimated_s(tabs) == pytest.approx(saved, rel=1e-6)


def test_a_share_of_whole_micro_batches_keeps_the_searchs_time():
    config, tabs = _config_and_tables()
    for share in (MICRO, 2 * MICRO, 2 * MICRO + 3):
        rep = assemble._Replica(config, share, [])
        assert rep.estimated_s(tabs) == rep.time_s()
