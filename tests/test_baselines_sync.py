"""The baselines charge the gradient sync the simulator runs: splits that do not nest fragment their
groups into a chain (planner.search.sync.chained_sync_end_s), and a metis plan of such splits is
estimated within 5% of its simulation."""

from __future__ import annotations

import pytest

from backends.sim import simulate_plan
from costmodel.network import ring_allreduce_s
from planner.api import PlanOptions, plan
from planner.core.cluster import Link
from planner.search import align
from planner.search.sync import SyncLane, chained_sync_end_s
from tests import synthetic as syn
from tests.helpers import CLUSTERS, EXAMPLES

EST_SIM_TOLERANCE = 0.05       # benchmarks/plan_quality.py's: every plan within 5% of its simulation


def _four_blocks():
    t = syn.table("x", 1.0, blocks=4, devices=8, per_node=8)
    return syn.tables([t], 8, grad_gib=[1.0, 1.0, 1.0, 1.0])


def test_splits_that_do_not_nest_sync_one_group_after_another():
    tabs = _four_blocks()
    link = Link("inter", tabs.inter_bandwidth_bytes_s, tabs.inter_latency_s)
    g = tabs.grad_bytes[0]
    # cuts after block 2 and after block 3: the groups are blocks 0-1 (A0, B0), block 2 (A1, B0), block 3 (A1, B1)
    a = SyncLane(0, (0, 2, 4), 1, (0.0, 0.0))
    b = SyncLane(0, (0, 3, 4), 1, (0.0, 0.0))
    ends = chained_sync_end_s(tabs, [a, b], link)
    two, one = ring_allreduce_s(2 * g, 2, link), ring_allreduce_s(g, 2, link)
    assert ends[0] == pytest.approx([two, two + 2 * one])      # A1 waits for B0, then syncs block 3
    assert ends[1] == pytest.approx([two + one, two + 2 * one])
    assert max(ends[0]) > ring_allreduce_s(2 * g, 2, link)      # more than the heaviest stage's own group


def test_equal_splits_sync_each_stage_on_its_own_from_when_it_is_ready():
    tabs = _four_blocks()
    link = Link("inter", tabs.inter_bandwidth_bytes_s, tabs.inter_latency_s)
    g = tabs.grad_bytes[0]
    lane = SyncLane(0, (0, 2, 4), 3, (0.5, 0.2))        # three replicas; stage 1 done first
    ends = chained_sync_end_s(tabs, [lane], link)
    assert ends[0] == pytest.approx([0.5 + ring_allreduce_s(2 * g, 3, link), 0.2 + ring_allreduce_s(2 * g, 3, link)])
    # one replica alone has nothing to synchronise
    assert chained_sync_end_s(tabs, [SyncLane(0, (0, 2, 4), 1, (0.5, 0.2))], link) == [[0.5, 0.2]]


def test_metis_estimate_of_splits_that_do_not_nest_is_the_simulated_time():
    # ResNet on T4 and Jetson nodes in two stages: each device type's balanced split cuts elsewhere
    result = plan(EXAMPLES / "resnet" / "model.py", CLUSTERS / "edge-t4.yaml",
                  PlanOptions(global_batch=64, strategy="metis", stages=2, micro_batch=2, runners_up=False))
    p = result.plan
    bounds = list({tuple(st.first_block for st in r.stages) + (len(p.blocks),) for r in p.replicas})
    assert align.conflicts(bounds), bounds          # the case this test is about: misaligned splits
    sim = simulate_plan(p, result.cluster)
    assert p.estimates.iteration_s == pytest.approx(sim.iteration_s, rel=EST_SIM_TOLERANCE)
    assert p.estimates.sync_s > 0.5 * (sim.iteration_s - sim.pipeline_s)
