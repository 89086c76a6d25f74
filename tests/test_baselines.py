"""Baseline strategies: verified plans through the one assemble path; the ILP is never slower."""

from __future__ import annotations

import pytest

from backends.sim import simulate_plan
from passes.verify import verify_plan
from planner.api import PlanOptions, plan
from planner.core.errors import PlanningError
from planner.search import baselines, ilp
from planner.search.configs import build_configs
from planner.search.strategies import STRATEGIES
from tests import synthetic as syn
from tests.helpers import CLUSTERS, EXAMPLES

GLOBAL_BATCH = 64
CLUSTER_NAMES = ("cpu-hetero-4", "seed-mixed-32")
BASELINES = tuple(baselines.SOLVERS)
# the ILP optimises its estimate and the simulator overlaps transfers the estimate serialises:
# allow it float noise, not a loss
SIM_TOLERANCE = 1e-9


def _plan(cluster: str, strategy: str):
    return plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / f"{cluster}.yaml",
                PlanOptions(global_batch=GLOBAL_BATCH, strategy=strategy))


@pytest.fixture(scope="module")
def ilp_times() -> dict[str, float]:
    out = {}
    for cluster in CLUSTER_NAMES:
        result = _plan(cluster, "ilp")
        out[cluster] = simulate_plan(result.plan, result.cluster).iteration_s
    return out


def test_baselines_are_registered_strategies():
    assert set(BASELINES) == {"uniform", "fastest", "megatron", "metis"}
    assert set(BASELINES) <= set(STRATEGIES)


@pytest.mark.parametrize("cluster", CLUSTER_NAMES)
@pytest.mark.parametrize("strategy", BASELINES)
def test_baseline_plan_is_verified_and_no_faster_than_ilp(cluster, strategy, ilp_times):
    result = _plan(cluster, strategy)
    p = result.plan
    verify_plan(p, result.cluster)
    assert p.solver.strategy == strategy
    assert sum(r.batch_share for r in p.replicas) == GLOBAL_BATCH
    sim = simulate_plan(p, result.cluster)
    assert ilp_times[cluster] <= sim.iteration_s * (1 + SIM_TOLERANCE)


def test_uniform_gives_equal_shares_and_equal_blocks():
    p = _plan("cpu-hetero-4", "uniform").plan
    shares = [r.batch_share for r in p.replicas]
    assert max(shares) - min(shares) <= 1
    assert len(p.replicas) == 4          # every device
    for r in p.replicas:
        sizes = [st.last_block - st.first_block + 1 for st in r.stages]
        assert max(sizes) - min(sizes) <= 1


def test_fastest_uses_one_device_type():
    p = _plan("seed-mixed-32", "fastest").plan
    assert {st.device_type for r in p.replicas for st in r.stages} == {"A100-40GB"}


def test_metis_gives_faster_replicas_more_rows():
    p = _plan("cpu-hetero-4", "metis").plan
    share = {r.node_group: r.batch_share for r in p.replicas}
    assert share["fast"] > share["slow"]


def test_equal_bounds_and_proportional_shares():
    assert baselines.equal_bounds(7, 3) == (0, 3, 5, 7)
    assert baselines.proportional_shares(10, [3.0, 1.0, 1.0]) == [6, 2, 2]
    assert sum(baselines.proportional_shares(64, [1.0, 2.0, 3.5])) == 64


def test_baseline_that_cannot_fit_says_why():
    # 64 GiB of state on 20 GiB devices: no depth up to the device count fits
    t = syn.table("x", 1.0, blocks=8, devices=2, per_node=2, capacity_gib=20.0, state_gib=[8.0] * 8)
    tabs = syn.tables([t], 16)
    with pytest.raises(PlanningError, match="uniform.*fit"):
        baselines.uniform_solution(tabs, PlanOptions(global_batch=16))


def test_baseline_estimate_uses_the_ilp_formulas():
    t = syn.table("x", 1.0, blocks=4, devices=4, per_node=4)
    tabs = syn.tables([t], 8)
    sol = baselines.megatron_solution(tabs, PlanOptions(global_batch=8))
    best_ilp = ilp.solve(tabs, build_configs(tabs))
    assert sol.objective_s >= best_ilp.objective_s - 1e-9
    assert sum(c.replicas * c.share for c in sol.choices) == 8
