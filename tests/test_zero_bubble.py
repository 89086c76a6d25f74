"""ZB-H1 (`zbh1`): its action lists, its makespan against the simulator, its memory, and a plan's own estimate."""

from __future__ import annotations

import random

import pytest

from backends.sim import simulate_plan
from backends.sim.engine import simulate
from backends.sim.inputs import ReplicaWork, SimInput, StageWork
from costmodel import memory
from planner.core import schedule as sched
from planner.core.errors import PassError
from planner.core.ir import Plan
from planner.frontend.cluster import load_cluster
from planner.search import zero_bubble
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli


def _simulated_s(f, b, w, x, M, schedule="zbh1") -> float:
    S = len(f)
    stages = tuple(StageWork(s, (f[s],) * M, (b[s],) * M, (x[s],) * M if s + 1 < S else (),
                             (x[s - 1],) * M if s > 0 else (), 0.0, (w[s],) * M) for s in range(S))
    return simulate(SimInput(S, M, (ReplicaWork(0, schedule, stages),), ()), timeline=False).iteration_s


@pytest.mark.parametrize("S,M", [(1, 3), (2, 1), (3, 2), (4, 6), (8, 25)])
def test_every_stage_runs_f_b_w_once_without_deadlock_and_keeps_at_most_s_in_flight(S, M):
    acts = sched.make("zbh1", S, M)
    sched.check(acts, M)
    assert sched.from_text(sched.to_text(acts)) == acts
    for s, device in enumerate(acts):
        live = peak = 0
        for a in device:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak == memory.in_flight_micro_batches("zbh1", s, S, M) == min(S, M)
        held = [a.micro for a in device if a.kind == "W"]
        assert held == sorted(held)


def test_the_checker_refuses_a_weight_gradient_before_its_backward():
    acts = sched.make("zbh1", 2, 2)
    i, j = next(k for k, a in enumerate(acts[1]) if a.kind == "B"), \
        next(k for k, a in enumerate(acts[1]) if a.kind == "W")
    acts[1][i], acts[1][j] = acts[1][j], acts[1][i]
    with pytest.raises(PassError, match="W0 before"):
        sched.check(acts, 2)


def test_makespan_is_the_simulators_and_the_search_table_within_two_percent():
    rng = random.Random(3)
    worst = 0.0
    for _ in range(60):
        S = rng.choice([2, 3, 4, 6, 8, 12])
        f = tuple(rng.uniform(0.5, 2) for _ in range(S))
        b = tuple(2 * v * rng.uniform(0.8, 1.3) for v in f)
        w = tuple(v * rng.uniform(0, 0.6) for v in b)
        x = tuple(rng.choice([0.0, rng.uniform(0, 1.5)]) for _ in range(S))
        table = zero_bubble.makespans_s(f, b, w, x, 64)
        for M in (1, 2, S, 2 * S + 3, 17, 40, 64):
            exact = _simulated_s(f, b, w, x, M)
            assert zero_bubble.makespan_s(f, b, w, x, M) == exact          # the same sums, to the bit
            if M in zero_bubble.replayed_counts(S, 64):
                assert table[M] == exact
            worst = max(worst, abs(table[M] - exact) / exact)
    assert worst <= 0.02


def test_weight_gradients_fill_the_drain():
    # equal stages: 1F1B idles (S - 1)(f + b) per stage; ZB-H1 about (S - 1)(f + b - 2w) less
    f, b, w, x = (1.0,) * 8, (2.0,) * 8, (0.9,) * 8, (0.0,) * 8
    one_f_one_b, zbh1 = _simulated_s(f, b, w, x, 16, "1f1b"), _simulated_s(f, b, w, x, 16)
    assert one_f_one_b == pytest.approx((16 + 7) * 3.0)
    assert zbh1 < one_f_one_b - 7 * 0.9
    assert zbh1 >= 16 * 3.0


@pytest.mark.slow
def test_a_zbh1_plan_prices_weight_gradients_and_its_estimate_is_its_simulation(tmp_path):
    out = tmp_path / "out"
    proc = run_plan_cli(str(EXAMPLES / "gpt" / "model.py"), "--cluster", str(CLUSTERS / "cpu-4.yaml"),
                        "--schedule", "zbh1", "--stages", "4", "--global-batch", "32", "--micro-batch", "2",
                        "--no-runners-up", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert {r.schedule for r in plan.replicas} == {"zbh1"}
    # matmuls against weights: about half of each transformer stage's backward is weight gradients
    for st in plan.replicas[0].stages:
        assert 0.3 < st.wgrad_s_per_sample / st.bwd_s_per_sample < 0.6
    sim = simulate_plan(plan, load_cluster(CLUSTERS / "cpu-4.yaml"))
    assert plan.estimates.iteration_s == pytest.approx(sim.iteration_s, rel=1e-6)   # the ILP counts whole ns
