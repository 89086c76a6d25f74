"""ZB-H1 (`zbh1`): its action lists, its makespan against the simulator, its memory, and a plan's own estimate."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from backends.sim import simulate_plan
from backends.sim.engine import simulate
from backends.sim.inputs import ReplicaWork, SimInput, StageWork
from backends.torchdist.program import weight_split
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


class _TwoOutputs(nn.Module):
    """A stage whose second output comes from its own token ids alone: the embedding's paths never meet the
    received input's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.embedding = nn.Linear(4, 4), nn.Embedding(10, 4)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, received, ids):
        shared = self.linear(received) + self.bias       # the bias is read twice, along two paths
        return torch.relu(shared) + self.bias * shared, self.embedding(ids)


def _split_backward(module, outputs_of, received):
    """Whether the split applies, and every parameter's gradient after B and W (or one backward)."""
    outputs = outputs_of(received)
    grads = [torch.ones_like(o) for o in outputs]
    clean = weight_split.splits_cleanly(outputs, [received], module.parameters())
    if clean:
        groups = weight_split.input_gradients(outputs, grads, [received], module.parameters())
        weight_split.weight_gradients(module.parameters(), groups)
    else:
        torch.autograd.backward(outputs, grads)
    return clean, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}, received.grad.clone()


def test_the_split_backward_gives_every_weight_its_gradient_once_or_is_not_used():
    torch.manual_seed(0)
    m, ids = _TwoOutputs(), torch.randint(0, 10, (3,))
    x = torch.randn(3, 4)
    whole = x.clone().requires_grad_(True)
    outs = m(whole, ids)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    reference = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    # both outputs: the embedding would be in no group, so the stage runs its backward whole
    clean, got, dx = _split_backward(m, lambda r: m(r, ids), x.clone().requires_grad_(True))
    assert not clean and all(torch.equal(got[n], reference[n]) for n in reference)
    assert torch.equal(dx, whole.grad)
    m.zero_grad(set_to_none=True)
    # the first output alone: split, the twice-read bias summed once
    only_first = [n for n in reference if not n.startswith("embedding")]
    m2 = _TwoOutputs()
    m2.load_state_dict(m.state_dict())
    one = x.clone().requires_grad_(True)
    m2(one, ids)[0].sum().backward()
    clean, got, _ = _split_backward(m, lambda r: [m(r, ids)[0]], x.clone().requires_grad_(True))
    assert clean
    for name in only_first:
        assert torch.allclose(got[name], dict(m2.named_parameters())[name].grad, rtol=1e-6, atol=1e-7), name


def test_groups_sharing_a_weight_are_merged():
    a, b, c = object(), object(), object()
    merged = weight_split.disjoint_groups([
        {"params": {a}, "intermediates": ["n1"], "grads": [(1,)]},
        {"params": {b}, "intermediates": ["n2", "n3"], "grads": [(2,), None]},
        {"params": {a, c}, "intermediates": ["n1", "n4"], "grads": [(1,), (4,)]},
    ])
    assert len(merged) == 2
    joined = next(g for g in merged if a in g["params"])
    assert joined["params"] == {a, c} and joined["intermediates"] == ["n1", "n4"] and joined["grads"] == [(1,), (4,)]
    alone = next(g for g in merged if b in g["params"])
    assert alone["intermediates"] == ["n2"]          # n3: no gradient reached it in B
