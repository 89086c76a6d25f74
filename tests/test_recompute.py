"""Recompute is decided per stage: exactly the stages whose activations do not fit otherwise recompute,
the split is still the exact optimum, and a pipeline that mixes both trains as one process does."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.api import PlanOptions, plan
from planner.core.ir import Plan
from planner.search.split import block_phases_s, solve_split, stage_costs
from tests import synthetic as syn
from tests.helpers import EXAMPLES, run_plan_cli
from tests.test_e2e import _check_against_reference

LINK = (1e10, 5e-6)


def _brute_force(t, S: int, m: int, grads):
    """Best split over every cut set, each costed by stage_costs with recompute where needed."""
    N, best = len(t.fwd_s), None
    for cuts in itertools.combinations(range(1, N), S - 1):
        split = stage_costs(t, (0, *cuts, N), m, (LINK,) * (S - 1), grads, recompute=True)
        if any(mem > t.capacity_bytes for mem in split.stage_memory_bytes):
            continue
        if best is None or split.max_stage_s < best.max_stage_s - 1e-12:
            best = split
    return best


def test_the_first_stages_recompute_and_the_last_does_not() -> None:
    """8 equal blocks, 4 stages: stage s holds 4 - s micro-batches under 1F1B, so activations of
    1.5 GiB per block and micro-batch overflow 10 GiB on the first stages only."""
    t = syn.table("a", 1.0, blocks=8, devices=4, per_node=4, capacity_gib=10.0, state_gib=[1.0] * 8, act_gib=1.5,
                  boundary_bytes=1e6)
    grads = (1e6,) * 8
    split = solve_split(t, 4, 1, (LINK,) * 3, grads, recompute=True)
    assert split.bounds == (0, 2, 4, 6, 8)
    assert split.stage_recompute == (True, True, False, False)   # 2 + 3 x 4 > 10 and 2 + 3 x 3 > 10; 2 + 3 x 2 <= 10
    assert all(mem <= t.capacity_bytes for mem in split.stage_memory_bytes)
    everywhere = [sum(block_phases_s(t, range(lo, hi), 1, True)) for lo, hi in zip(split.bounds, split.bounds[1:])]
    assert split.fwd_s[3] + split.bwd_s[3] < everywhere[3]                     # the last stage runs its forward once
    # without recompute the best split (0, 1, 2, 4, 8) ends with 4 blocks: recomputing the first stages is faster
    plain = solve_split(t, 4, 1, (LINK,) * 3, grads)
    assert not plain.recompute and split.max_stage_s < plain.max_stage_s


@pytest.mark.parametrize("seed", range(3))
def test_the_split_with_recompute_where_needed_is_the_exact_optimum(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(30):
        N, S = rng.randint(3, 7), rng.randint(2, 4)
        t = syn.table("a", 1.0, blocks=N, devices=S, per_node=S, capacity_gib=rng.uniform(4.0, 12.0),
                      block_s=[rng.uniform(0.5e-3, 3e-3) for _ in range(N)],
                      state_gib=[rng.uniform(0.2, 2.0) for _ in range(N)], act_gib=rng.uniform(0.2, 1.5),
                      boundary_bytes=rng.uniform(1e5, 2e8))
        grads, m = (1e6,) * N, rng.choice([1, 2])
        if S > N:
            continue
        best, got = _brute_force(t, S, m, grads), solve_split(t, S, m, (LINK,) * (S - 1), grads, recompute=True)
        assert (best is None) == (got is None)
        if best is not None:
            assert got.max_stage_s == pytest.approx(best.max_stage_s, rel=1e-12)
            checked += any(got.stage_recompute) and not all(got.stage_recompute)
    assert checked > 0           # some instances mix recomputed and plain stages


SPEC = """name: cpu-2
devices:
  cpu-small: {{base: CPU, memory_gib: {memory_gib!r}}}
nodes:
  - {{name: box, count: 1, device: cpu-small, per_node: 2, intra_link: shm}}
network:
  inter_node: {{kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}}
"""
FLAGS = ("--global-batch", "64", "--stages", "2", "--use-all-devices", "--micro-batch", "16", "--memory-margin", "0")


@pytest.mark.slow
def test_a_pipeline_whose_first_stage_recomputes_trains_as_one_process(tmp_path) -> None:
    """The mlp in 2 stages: with the devices' memory 1 KiB short of what the first stage needs to
    keep its two in-flight micro-batches, that stage recomputes and the second does not."""
    roomy = tmp_path / "roomy.yaml"
    roomy.write_text(SPEC.format(memory_gib=64.0))
    options = PlanOptions(global_batch=64, stages=2, use_all_devices=True, micro_batch=16, memory_margin=0.0,
                          schedule="1f1b", runners_up=False)
    needs = [s.memory_bytes for s in plan(EXAMPLES / "mlp" / "model.py", roomy, options).plan.replicas[0].stages]
    assert needs[0] > needs[1] + 2048
    tight = tmp_path / "tight.yaml"
    tight.write_text(SPEC.format(memory_gib=(needs[0] - 1024) / 2**30))
    out = tmp_path / "out"
    proc = run_plan_cli(str(EXAMPLES / "mlp" / "model.py"), "--cluster", str(tight), *FLAGS, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    planned = Plan.load(out)
    assert [[s.recompute for s in r.stages] for r in planned.replicas] == [[True, False]]
    _check_against_reference(out, planned, "mlp")
