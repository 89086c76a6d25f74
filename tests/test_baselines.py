"""Baseline strategies: verified plans through the one assemble path; the ILP is never slower; megatron
and metis choose tensor parallelism as their recipes do."""

from __future__ import annotations

import pytest

from backends.sim import simulate_plan
from costmodel import tensor_parallel
from passes.verify import verify_plan
from planner.api import PlanOptions, plan
from planner.core.errors import PlanningError
from planner.search import baselines, degrees, ilp
from planner.search.configs import build_configs
from planner.search.options import SearchOptions
from planner.search.strategies import STRATEGIES
from tests import synthetic as syn
from tests import synthetic_tp as syn_tp
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
        baselines.uniform_solution(tabs, SearchOptions())


def test_baseline_estimate_uses_the_ilp_formulas():
    t = syn.table("x", 1.0, blocks=4, devices=4, per_node=4)
    tabs = syn.tables([t], 8)
    sol, priced = baselines.megatron_solution(tabs, SearchOptions())
    assert priced is tabs                # no shardings: degree 1
    best_ilp = ilp.solve(tabs, build_configs(tabs))
    assert sol.objective_s >= best_ilp.objective_s - 1e-9
    assert sum(c.replicas * c.share for c in sol.choices) == 8


# ---- tensor parallelism in the baselines ------------------------------------------------------------
def _sharded_tables(per_node: tuple[int, ...], state_gib: float, global_batch: int = 16, blocks: int = 8,
                    degrees_: tuple[int, ...] = (1, 2, 4, 8)):
    classes = [syn.table(f"c{ci}", 1.0 + ci, blocks=blocks, devices=2 * p, per_node=p, state_gib=[state_gib] * blocks,
                         capacity_gib=40.0, intra_gbyte_s=300.0) for ci, p in enumerate(per_node)]
    tabs = syn.tables(classes, global_batch, grad_gib=[state_gib / 4] * blocks)
    return syn_tp.with_shardings(tabs, [syn_tp.sharding(g, degrees=degrees_) for g in tabs.grad_bytes])


def test_megatron_uses_tp_across_the_gpus_of_a_node():
    sol, priced = baselines.megatron_solution(_sharded_tables((8, 8), 2.0), SearchOptions())
    assert {c.tp_degree for c in priced.classes} == {8}
    assert sum(c.replicas * c.share for c in sol.choices) == 16


def test_megatron_degree_is_the_largest_the_pairs_and_every_node_allow():
    opts = SearchOptions()
    assert baselines.megatron_degree(_sharded_tables((8, 4), 2.0), opts) == 4          # a node of 4 caps it
    assert baselines.megatron_degree(_sharded_tables((8,), 2.0, degrees_=(1, 2)), opts) == 2   # pairs cap it
    assert baselines.megatron_degree(_sharded_tables((8,), 2.0), SearchOptions(tp=2)) == 2     # --tp wins


def test_megatron_takes_the_fewest_stages_that_fit():
    # 8 blocks of 8 GiB at TP=8: 1/8 of 90% of the state per shard, the whole model on one group
    sol, priced = baselines.megatron_solution(_sharded_tables((8,), 8.0), SearchOptions())
    assert {c.config.num_stages for c in sol.choices} == {1}
    # 24 GiB blocks: 2.4 + 0.9*24/8 = 5.1 GiB a block per shard; 7 blocks fit 40 GiB, so two stages
    sol, priced = baselines.megatron_solution(_sharded_tables((8,), 24.0), SearchOptions())
    assert {c.config.num_stages for c in sol.choices} == {2}


def test_metis_picks_the_best_degree():
    tabs = _sharded_tables((8, 8), 2.0, global_batch=4)
    sol, priced = baselines.metis_solution(tabs, SearchOptions())
    degree = priced.classes[0].tp_degree
    for t in tensor_parallel.usable_degrees(tabs, tabs.shardings):
        forced, _ = baselines.metis_solution(tabs, SearchOptions(tp=t))
        assert sol.objective_s <= forced.objective_s
    assert degree > 1          # four samples on 32 devices: the pipelines cannot fill, TP does better


@pytest.mark.parametrize("name", ["megatron", "metis"])
def test_ilp_is_never_slower_than_a_tp_baseline(name):
    tabs = _sharded_tables((8, 8), 2.0, global_batch=4)
    sol, _ = baselines.SOLVERS[name](tabs, SearchOptions())
    assert degrees.best(tabs, SearchOptions())[0][0].objective_s <= sol.objective_s * (1 + 1e-9)
