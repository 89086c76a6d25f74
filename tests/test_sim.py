"""The event simulator against hand-worked timelines and textbook makespans, its input from a plan,
the Gantt chart it draws, and its agreement with the planner's estimates.

Every expected number here is worked out by hand (in the comments) or by a closed formula of the
schedule, never by calling the code under test again.
"""

from __future__ import annotations

import pytest

from backends.report.gantt import render_gantt
from backends.sim import ReplicaWork, SimInput, StageWork, SyncWork, from_plan, simulate, simulate_plan
from costmodel import compute
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
# one time unit of the hand-built inputs (about a millisecond): a power of two, so every sum and
# quarter below is exact in binary and the Gantt columns fall on exact boundaries
U = 2.0 ** -10


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


def _two_unequal_stages() -> SimInput:
    """Stage 0: F 1, B 2 per micro-batch, activations take 0.5 to stage 1; stage 1: F 2, B 3, input
    gradients take 0.25 back; three micro-batches under 1F1B; optimizer 0.5 on each rank (units U)."""
    s0 = StageWork(0, (1 * U,) * 3, (2 * U,) * 3, (0.5 * U,) * 3, (), 0.5 * U)
    s1 = StageWork(1, (2 * U,) * 3, (3 * U,) * 3, (), (0.25 * U,) * 3, 0.5 * U)
    return SimInput(world_size=2, global_batch=3, replicas=(ReplicaWork(0, "1f1b", (s0, s1)),), syncs=())


# Worked by hand. 1F1B with S=2: stage 0 runs F0 F1 B0 F2 B1 B2 (one warm-up forward), stage 1 F0 B0 F1
# B1 F2 B2. Stage 0: F0 [0,1], F1 [1,2]; activations reach stage 1 at 1.5, 2.5 and (after F2) 10.25.
# Stage 1: F0 [1.5,3.5], B0 [3.5,6.5] -> gradient at stage 0 at 6.75; F1 [6.5,8.5], B1 [8.5,11.5] -> 11.75;
# F2 waits for the rank, not the data: [11.5,13.5], B2 [13.5,16.5] -> 16.75. Stage 0 waits for each
# gradient: B0 [6.75,8.75], F2 [8.75,9.75], B1 [11.75,13.75], B2 [16.75,18.75]. Then each optimizer.
HAND_TIMELINE = {
    0: [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 6.75, 8.75), ("0F2", 8.75, 9.75), ("0B1", 11.75, 13.75),
        ("0B2", 16.75, 18.75), ("opt", 18.75, 19.25)],
    1: [("1F0", 1.5, 3.5), ("1B0", 3.5, 6.5), ("1F1", 6.5, 8.5), ("1B1", 8.5, 11.5), ("1F2", 11.5, 13.5),
        ("1B2", 13.5, 16.5), ("opt", 16.5, 17.0)],
}


def test_two_stage_1f1b_matches_hand_calculation():
    # no transfers: (M + S - 1) * (f + b) for equal stages
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1, 1)]), _spec(2))
    assert result.iteration_s == pytest.approx(4 * (F_S + B_S))
    assert result.busy_s == pytest.approx((3 * (F_S + B_S),) * 2)
    assert result.bubble_fraction == pytest.approx(1 - 18 / 24)


def test_unequal_1f1b_stages_follow_the_hand_worked_timeline():
    result = simulate(_two_unequal_stages())
    for rank, expected in HAND_TIMELINE.items():
        assert [(sp.label, sp.start_s / U, sp.end_s / U) for sp in result.spans_of(rank)] == expected
    assert result.pipeline_s == 18.75 * U and result.iteration_s == 19.25 * U
    assert result.busy_s == (9 * U, 15 * U)                        # 3 x (1 + 2), 3 x (2 + 3)
    assert result.bubble_fraction == pytest.approx(1 - 24 / (2 * 19.25))
    assert result.throughput_samples_s == pytest.approx(3 / (19.25 * U))


def test_transfers_delay_the_dependent_actions():
    # d per transfer; stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1 (1F1B), two micro-batches of one row.
    # s0 F0 [0,1]; s1 F0 [1+d,2+d] B0 [2+d,4+d]; s1 F1 [4+d,5+d] B1 [5+d,7+d]
    # s0 B0 [4+2d,6+2d]; s0 B1 waits for s1's B1 gradient: [7+2d, 9+2d]  (ms, for d < 1 ms)
    bytes_per_sample = 500.0
    d = 0.5e-3                                   # 500 bytes at 1 MB/s, no latency
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1)], bytes_per_sample=bytes_per_sample),
                           _spec(2))
    assert result.iteration_s == pytest.approx(9 * F_S + 2 * d)
    assert [sp.label for sp in result.spans_of(0)] == ["0F0", "0F1", "0B0", "0B1", "opt"]
    assert result.spans_of(0)[3].start_s == pytest.approx(7 * F_S + 2 * d)


def test_gpipe_runs_all_forwards_first():
    result = simulate_plan(_plan([[_stage(0, 0), _stage(1, 1)]], [(1, 1)], schedule="gpipe"), _spec(2))
    assert result.iteration_s == pytest.approx(3 * (F_S + B_S))
    assert [sp.label for sp in result.spans_of(1)][:4] == ["1F0", "1F1", "1B0", "1B1"]


def test_gpipe_makespan_is_the_flow_shop_formula():
    """GPipe without transfers is two flow shops of M identical jobs: all forwards (S stages), then all
    backwards (S stages, reversed), so its makespan is sum(f) + (M-1) max(f) + sum(b) + (M-1) max(b)."""
    fwd, bwd, M = (1.0, 3.0, 2.0), (2.0, 1.0, 4.0), 4
    stages = tuple(StageWork(s, (fwd[s] * U,) * M, (bwd[s] * U,) * M, (0.0,) * M if s < 2 else (),
                             (0.0,) * M if s > 0 else (), 0.0) for s in range(3))
    result = simulate(SimInput(3, M, (ReplicaWork(0, "gpipe", stages),), ()))
    expected = sum(fwd) + (M - 1) * max(fwd) + sum(bwd) + (M - 1) * max(bwd)       # 6 + 9 + 7 + 12
    assert result.iteration_s == expected * U == 34 * U
    # the bottleneck forward stage (3 per micro-batch) runs its four forwards back to back
    assert [(sp.start_s / U, sp.end_s / U) for sp in result.spans_of(1)[:M]] == [(1, 4), (4, 7), (7, 10), (10, 13)]


def test_sync_waits_for_the_slowest_member_then_optimizer():
    # rank 0: one micro-batch, busy until 3; rank 1: two, until 6. The collective (4) starts at 6 on both,
    # then each rank's optimizer: 10 + 0.5 and 10 + 1.
    r0 = StageWork(0, (1 * U,), (2 * U,), (), (), 0.5 * U)
    r1 = StageWork(1, (1 * U,) * 2, (2 * U,) * 2, (), (), 1 * U)
    inp = SimInput(2, 3, (ReplicaWork(0, "1f1b", (r0,)), ReplicaWork(1, "1f1b", (r1,))), (SyncWork(0, (0, 1), 4 * U),))
    result = simulate(inp)
    assert [(sp.label, sp.start_s / U, sp.end_s / U) for sp in result.spans_of(0)] == \
        [("0F0", 0, 1), ("0B0", 1, 3), ("sync0", 6, 10), ("opt", 10, 10.5)]
    assert [(sp.label, sp.start_s / U, sp.end_s / U) for sp in result.spans_of(1)][-2:] == \
        [("sync0", 6, 10), ("opt", 10, 11)]
    assert result.pipeline_s == 6 * U and result.iteration_s == 11 * U


def test_from_plan_gives_per_micro_batch_times_transfers_and_syncs():
    p = _plan([[_stage(0, 0), _stage(1, 1)]], [(2, 2, 1)], bytes_per_sample=100.0)
    (replica,) = from_plan(p, _spec(2)).replicas
    first, last = replica.stages
    # rows x per-sample time; 100 bytes per row at 1 MB/s each way
    assert first.fwd_s == pytest.approx((2e-3, 2e-3, 1e-3)) and first.bwd_s == pytest.approx((4e-3, 4e-3, 2e-3))
    assert first.send_fwd_s == pytest.approx((2e-4, 2e-4, 1e-4)) and first.send_bwd_s == ()
    assert last.send_bwd_s == pytest.approx((2e-4, 2e-4, 1e-4)) and last.send_fwd_s == ()
    assert (first.rank, last.rank, replica.schedule) == (0, 1, "1f1b")

    param_bytes = 4e6
    group = GradGroup(0, (0, 1), ("p0", "p1"), param_bytes, "none", "ring", 0.0)
    synced = from_plan(_plan([[_stage(0, 0, param_bytes)], [_stage(0, 1, param_bytes)]], [(1,), (2,)],
                             param_bytes=param_bytes, groups=(group,)), _spec(2))
    # ring all-reduce over 2 ranks: each sends and receives the whole 4 MB once, at 1 MB/s
    assert synced.syncs == (SyncWork(0, (0, 1), pytest.approx(4.0)),)
    # the optimizer step the cost model priced for the planner (costmodel.compute), no other figure
    device = _spec(2).devices()[0].type
    assert synced.replicas[0].stages[0].optimizer_s == pytest.approx(compute.optimizer_step_s(param_bytes, 1, device))


def test_gantt_draws_the_hand_worked_timeline():
    # 77 columns of U/4 over the 19.25 U iteration: every span starts and ends on a column boundary
    text = render_gantt(simulate(_two_unequal_stages()), width=77)
    rows = [line for line in text.splitlines() if line.startswith("r")]
    fill = {"F": "F", "B": "B", "o": "o"}

    def row(spans: list[tuple[str, float, float]]) -> str:
        cells = ["."] * 77
        for label, start, end in spans:
            first, last = int(start * 4), int(end * 4)
            text = label if label[0].isdigit() and last - first > len(label) else ""
            char = fill[label[1] if label[0].isdigit() else "o"]
            cells[first:last] = [text[k] if k < len(text) else char for k in range(last - first)]
        return "".join(cells)

    assert rows == [f"r0    |{row(HAND_TIMELINE[0])}|", f"r1    |{row(HAND_TIMELINE[1])}|"]
    # spelled out for rank 0: F0 F1, idle until the first gradient at 6.75, B0 F2, idle, B1, idle, B2, opt
    assert rows[0] == ("r0    |0F0F0F1F" + "." * 19 + "0B0BBBBB0F2F" + "." * 8 + "0B1BBBBB" + "." * 12
                       + "0B2BBBBBoo|")
    assert text.splitlines()[0].startswith("iteration 18.799 ms, bubble 38%")
    assert "1 more ranks" in render_gantt(simulate(_two_unequal_stages()), width=77, max_ranks=1)


@pytest.mark.parametrize("cluster,stages", [("cpu-hetero-4", None), ("cpu-hetero-4", 2),
                                            ("seed-mixed-32", None), ("seed-mixed-32", 2), ("edge-t4", None)])
def test_simulated_ilp_plan_agrees_with_its_estimate(cluster, stages):
    result = plan(EXAMPLES / "gpt" / "model.py", CLUSTERS / f"{cluster}.yaml",
                  PlanOptions(global_batch=64, stages=stages))
    sim = simulate_plan(result.plan, result.cluster)
    estimates = result.plan.estimates
    assert sim.iteration_s == pytest.approx(estimates.iteration_s, rel=EST_TOLERANCE)
    assert sim.busy_s == pytest.approx(estimates.busy_s, rel=EST_TOLERANCE)
    # without the timeline (the runners-up's use): the same times, to the bit, and no spans
    bare = simulate_plan(result.plan, result.cluster, timeline=False)
    assert (bare.iteration_s, bare.pipeline_s, bare.busy_s, bare.bubble_fraction) == (
        sim.iteration_s, sim.pipeline_s, sim.busy_s, sim.bubble_fraction)
    assert bare.timeline == () and sim.timeline
