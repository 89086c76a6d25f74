"""The event simulator: hand-computed pipelines, agreement with the planner's estimates, Gantt text."""

from __future__ import annotations

import pytest

from backends.report.gantt import render_gantt
from backends.sim import from_plan, simulate, simulate_plan
from backends.sim.inputs import optimizer_step_s
from costmodel.network import ring_allreduce_s
from planner.api import PlanOptions, plan
from planner.core.cluster import ClusterSpec, DeviceType, Link, NodeGroup
from planner.core.ir import (
    BlockInfo,
    Estimates,
    GradGroup,
    P2PEdge,
    Plan,
    PlanInputs,
    ReplicaPlan,
    SolverFacts,
    StagePlan,
)
from tests.helpers import CLUSTERS, EXAMPLES

F_S, B_S = 1e-3, 2e-3            # per sample, forward and backward, every stage
LINK = Link("test", bandwidth_bytes_s=1e6, latency_s=0.0)
EST_TOLERANCE = 0.05


def _spec(devices: int) -> ClusterSpec:
    dev = DeviceType("T", "generic", {"fp32": 1e12}, 1 << 34, 1e11)
    return ClusterSpec("hand", (NodeGroup("g", 1, dev, devices, LINK),), LINK)


def _stage(s: int, rank: int, param_bytes: float = 0.0) -> StagePlan:
    return StagePlan(index=s, first_block=s, last_block=s, last_node=f"n{s}", rank=rank, device=rank,
                     device_label=f"g/0:{rank}", device_type="T", precision="fp32", recompute=False,
                     fwd_s_per_sample=F_S, bwd_s_per_sample=B_S, overhead_s=0.0, memory_bytes=0.0,
                     params=(f"p{rank}",) if param_bytes else ())


def _plan(replicas: list[list[StagePlan]], micro: list[tuple[int, ...]], schedule: str = "1f1b",
          bytes_per_sample: float = 0.0, param_bytes: float = 0.0,
          groups: tuple[GradGroup, ...] = ()) -> Plan:
    blocks = tuple(BlockInfo(b, f"a{b}", f"n{b}", f"block{b}", 0.0, 0.0, param_bytes, 0.0, 0.0, "")
                   for b in range(max(len(r) for r in replicas)))
    reps, edges = [], []
    for ri, (stages, sizes) in enumerate(zip(replicas, micro)):
        reps.append(ReplicaPlan(ri, "g", tuple(stages), sum(sizes), sizes, schedule, 0.0))
        edges += [P2PEdge(ri, s - 1, s, stages[s - 1].rank, stages[s].rank, bytes_per_sample, "none")
                  for s in range(1, len(stages))]
    world = sum(len(r) for r in replicas)
    est = Estimates(0.0, 0.0, 0.0, 0.0, 0.0, (0.0,) * world, (0.0,) * world, (0.0,) * world)
    inputs = PlanInputs("m.py", "", "c.yaml", "", "hand", (), 2)
    return Plan(inputs, sum(sum(m) for m in micro), world, blocks, tuple(reps), groups, tuple(edges), est,
                SolverFacts("hand", "OPTIMAL", 0.0, 0.0, 0.0, 0))


def test_two_stage_1f1b_matches_hand_calculation():
    # no transfers: (M + S - 1) * (f + b) for equal stages
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1, 1)]), _spec(2))
    assert result.iteration_s == pytest.approx(4 * (F_S + B_S))
    assert result.busy_s == pytest.approx((3 * (F_S + B_S),) * 2)
    assert result.bubble_fraction == pytest.approx(1 - 18 / 24)


def test_transfers_delay_the_dependent_actions():
    # d per transfer; stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1 (1F1B), two micro-batches of one row.
    # s0 F0 [0,1]; s1 F0 [1+d,2+d] B0 [2+d,4+d]; s1 F1 [4+d,5+d] B1 [5+d,7+d]
    # s0 B0 [4+2d,6+2d]; s0 B1 waits for s1's B1 gradient: [7+2d, 9+2d]  (ms, for d < 1 ms)
    bytes_per_sample = 500.0
    d = LINK.transfer_s(bytes_per_sample)
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1)], bytes_per_sample=bytes_per_sample),
                           _spec(2))
    assert d == pytest.approx(0.5e-3)
    assert result.iteration_s == pytest.approx(9 * F_S + 2 * d)
    assert [sp.label for sp in result.spans_of(0)] == ["0F0", "0F1", "0B0", "0B1", "opt"]
    assert result.spans_of(0)[3].start_s == pytest.approx(7 * F_S + 2 * d)


def test_gpipe_runs_all_forwards_first():
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1)], schedule="gpipe"), _spec(2))
    assert result.iteration_s == pytest.approx(3 * (F_S + B_S))
    assert [sp.label for sp in result.spans_of(1)][:4] == ["1F0", "1F1", "1B0", "1B1"]


def test_sync_waits_for_the_slowest_member_then_optimizer():
    param_bytes = 4e6
    group = GradGroup(0, (0, 1), ("p0", "p1"), param_bytes, "none", "ring", 0.0)
    p = _plan([[_stage(0, 0, param_bytes)], [_stage(0, 1, param_bytes)]], [(1,), (2,)],
              param_bytes=param_bytes, groups=(group,))
    spec = _spec(2)
    result = simulate_plan(p, spec)
    slow_replica_s = 2 * (F_S + B_S)
    expected = slow_replica_s + ring_allreduce_s(param_bytes, 2, LINK) + optimizer_step_s(param_bytes,
                                                                                         spec.devices()[1])
    assert result.iteration_s == pytest.approx(expected)
    sync = [sp for sp in result.timeline if sp.label == "sync0"]
    assert len(sync) == 2 and all(sp.start_s == pytest.approx(slow_replica_s) for sp in sync)


def test_simulation_is_deterministic_and_input_is_plain_data():
    p = _plan([[_stage(0, 0), _stage(1, 1)]], [(2, 2, 1)], bytes_per_sample=100.0)
    inp = from_plan(p, _spec(2))
    assert inp.replicas[0].stages[0].fwd_s == pytest.approx((2 * F_S, 2 * F_S, F_S))
    assert simulate(inp) == simulate(inp)


def test_gantt_has_one_row_per_rank_and_labels():
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1, 1)]), _spec(2))
    text = render_gantt(result, width=60)
    rows = [line for line in text.splitlines() if line.startswith("r")]
    assert len(rows) == 2
    assert all(len(r) == len(rows[0]) for r in rows) and "|" in rows[0]
    assert "0F0" in rows[0] and "1B" in rows[1]
    assert "more ranks" in render_gantt(result, width=60, max_ranks=1)


@pytest.mark.parametrize("cluster,stages", [("cpu-hetero-4", None), ("cpu-hetero-4", 2),
                                            ("seed-mixed-32", None), ("seed-mixed-32", 2), ("edge-t4", None)])
def test_simulated_ilp_plan_agrees_with_its_estimate(cluster, stages):
    result = plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / f"{cluster}.yaml",
                  PlanOptions(global_batch=64, stages=stages))
    sim = simulate_plan(result.plan, result.cluster)
    assert sim.iteration_s == pytest.approx(result.plan.estimates.iteration_s, rel=EST_TOLERANCE)
    assert sim.throughput_samples_s == pytest.approx(64 / sim.iteration_s)
