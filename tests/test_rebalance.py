"""The parts of rebalancing (backends/torchdist/program/rebalance.py) one at a time: when it proposes new
shares, the slowdown that drifts per step, the new plan's communication verified as `plan` verifies it,
the stage graphs at new sizes holding the same tensors, and the ranks' agreement on real gloo."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import time

import pytest
import torch
import torch.distributed as dist

from backends.torchdist.program import comm_check, data, materialise
from backends.torchdist.program.p2p import P2P
from backends.torchdist.program.process_group import Context
from backends.torchdist.program.rebalance import (
    Trigger,
    agree,
    fitting_micro_batches,
    max_rows,
    planned_compute_s,
    regraph,
    reshare,
    speeds_of,
    verified,
)
from backends.torchdist.program.slowdown import Slowdown
from backends.torchdist.program.stages import StageGraphs
from passes.split import attr_name
from planner import frontend
from planner.core.ir import Plan
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli, spawn_gloo_workers

CPU = torch.device("cpu")
GLOBAL_BATCH = 24


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The MLP on cpu-hetero-4: two replicas of two stages, shares uneven by speed."""
    out = tmp_path_factory.mktemp("rebalance") / "out"
    proc = run_plan_cli(str(EXAMPLES / "mlp" / "model.py"), "--cluster", str(CLUSTERS / "cpu-hetero-4.yaml"),
                        "--global-batch", str(GLOBAL_BATCH), "--stages", "2", "--use-all-devices",
                        "--micro-batch", "4", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(out)
    assert len(plan.replicas) == 2 and plan.world_size == 4
    model_file = frontend.load_model_file(out / "program" / "model.py")
    return plan, model_file, materialise.build_meta(model_file, 0)


def _as_planned(plan: Plan, scale: float = 1.0) -> list[float]:
    """Every rank's compute seconds of a step as the plan costs it (times `scale`)."""
    return [scale * planned_compute_s(plan.stage_of_rank(rank)[1], plan.stage_of_rank(rank)[0].micro_batch_sizes)
            for rank in range(plan.world_size)]


# ----------------------------------------------------------------------------- when to re-solve

def test_balanced_figures_never_propose(planned):
    plan, _, _ = planned
    trigger = Trigger()
    # the planner balanced its shares by its own costs: measured at any uniform pace, they stay
    assert all(trigger.observe(plan, _as_planned(plan, 7.0)) is None for step in range(30))


def test_a_slowed_replica_is_proposed_after_the_window_median_and_the_patience(planned):
    plan, _, _ = planned
    trigger = Trigger(threshold=0.10, patience_steps=3, window_steps=5, warmup_steps=1)
    as_planned = _as_planned(plan)
    proposed = {}
    for step in range(20):
        figures = [as_planned[0] * (3.0 if step >= 4 else 1.0), *as_planned[1:]]     # rank 0 slows down
        found = trigger.observe(plan, figures)
        if found is not None:
            proposed[step] = found
            break
    # the window median turns at step 6 (three of steps 2..6 slowed), then three steps over the threshold
    assert list(proposed) == [8]
    proposal = proposed[8]
    assert proposal.shares.rows[0] < plan.replicas[0].batch_share          # work moves off the slowed replica
    assert sum(proposal.shares.rows) == plan.global_batch
    assert proposal.current_s > 1.1 * proposal.shares.slowest_s
    # the slowed stage's planned costs, three times over, are now its replica's slowest
    stage = plan.stage_of_rank(0)[1]
    slowed = proposal.speeds[0]
    assert slowed.seconds_per_row == pytest.approx(3.0 * (stage.fwd_s_per_sample + stage.bwd_s_per_sample))
    assert slowed.seconds_per_micro_batch == pytest.approx(3.0 * stage.overhead_s)
    assert proposal.speeds[1] == speeds_of(plan, as_planned)[1]          # the other replica as planned


def test_one_noisy_step_does_not_propose(planned):
    plan, _, _ = planned
    trigger = Trigger()
    as_planned = _as_planned(plan)
    for step in range(30):
        spike = 10.0 if step in (7, 15) else 1.0
        assert trigger.observe(plan, [as_planned[0] * spike, *as_planned[1:]]) is None


def test_memory_bounds_rows_and_micro_batches(planned):
    plan, _, _ = planned
    gpipe = [r.index for r in plan.replicas if r.schedule == "gpipe"]
    one_f_one_b = [r.index for r in plan.replicas if r.schedule == "1f1b"]
    for i in gpipe:           # GPipe: the planned micro-batches, no more of them
        replica = plan.replicas[i]
        assert max_rows(plan, i) == len(replica.micro_batch_sizes) * max(replica.micro_batch_sizes)
        assert fitting_micro_batches(plan, i) == ()
    for i in one_f_one_b:     # 1F1B on 64 GiB CPUs: every other size of the planner's fits
        assert max_rows(plan, i) is None
        assert fitting_micro_batches(plan, i) == tuple(m for m in (1, 2, 4, 8, 16) if m != 4)
    # a device with just the planned need free: only smaller micro-batches fit
    i = one_f_one_b[0]
    ranks = plan.replicas[i].ranks
    tight = tuple(need / (1.0 - plan.estimates.memory_margin) if rank in ranks else cap for rank, (need, cap)
                  in enumerate(zip(plan.estimates.memory_bytes, plan.estimates.capacity_bytes)))
    squeezed = dataclasses.replace(plan, estimates=dataclasses.replace(plan.estimates, capacity_bytes=tight))
    assert fitting_micro_batches(squeezed, i) == (1, 2)


def test_later_plans_keep_to_the_planned_memory(planned):
    plan, _, _ = planned
    i = next(r.index for r in plan.replicas if r.schedule == "1f1b")
    shares = tuple(r.batch_share + (4 if r.index == i else -4) for r in plan.replicas)
    grown = reshare(plan, shares, tuple(16 if r.index == i else max(r.micro_batch_sizes) for r in plan.replicas))
    speed = speeds_of(grown, _as_planned(grown), planned=plan)[i]
    assert speed.micro_batch == max(grown.replicas[i].micro_batch_sizes)
    assert set(speed.micro_batch_choices) == {*fitting_micro_batches(plan, i), max(plan.replicas[i].micro_batch_sizes)}


def test_after_a_change_the_trigger_waits_out_its_warm_up_and_window_again(planned):
    plan, _, _ = planned
    trigger = Trigger(patience_steps=1, window_steps=2, warmup_steps=1)
    slowed = [x * (3.0 if rank == 0 else 1.0) for rank, x in enumerate(_as_planned(plan))]
    assert [trigger.observe(plan, slowed) is None for _ in range(3)] == [True, True, False]
    trigger.reset()
    assert [trigger.observe(plan, slowed) is None for _ in range(3)] == [True, True, False]


# ----------------------------------------------------------------------------- the drifting slowdown

def _busy_cpu_s(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_slowdown_follows_its_drift_per_step_and_counts_the_compute():
    slowdown = Slowdown(1.0, CPU, P2P(), drift=lambda step: 3.0 if step >= 2 else 1.0)
    measured = []
    for step in range(4):
        slowdown.begin_step(step)
        with slowdown.padded():
            _busy_cpu_s(0.02)
        measured.append(slowdown.step_compute_s)
    assert slowdown.planned == 1.0 and slowdown.factor == 3.0
    assert measured[0] == pytest.approx(0.02, rel=0.5) and measured[1] == pytest.approx(0.02, rel=0.5)
    assert measured[2] / measured[0] == pytest.approx(3.0, rel=0.25)
    assert measured[3] / measured[1] == pytest.approx(3.0, rel=0.25)


# ----------------------------------------------------------------------------- verifying new shares

def _own_inputs(plan: Plan, rank: int, model_file, meta):
    """What rank `rank` of `plan` derives its streams from: its replica's stage graphs (on meta)."""
    replica, stage = plan.stage_of_rank(rank)
    graphs = StageGraphs(meta, model_file, [s.last_node for s in replica.stages], replica.micro_batch_sizes,
                         lambda rows: data.meta_inputs(model_file, rows))
    ctx = Context(rank, plan.world_size, replica, stage, CPU, {})
    return comm_check.own_inputs(ctx, graphs, meta.module)


def test_new_shares_run_only_once_verified(planned):
    plan, model_file, meta = planned
    shares = (9, 15)
    assert shares != tuple(r.batch_share for r in plan.replicas)
    stale = reshare(plan, shares)
    assert [r.micro_batch_sizes for r in stale.replicas] == [(4, 4, 1), (4, 4, 4, 3)]
    assert [r.stages for r in stale.replicas] == [r.stages for r in plan.replicas]
    # the plan's own record still holds the old shares' streams: a rank running the new ones is refused
    assert any(comm_check.mismatch(stale, rank, _own_inputs(stale, rank, model_file, meta)) is not None
               for rank in range(plan.world_size))
    checked = verified(stale, meta, model_file)
    assert checked.comm is not None and checked.comm != plan.comm
    for rank in range(plan.world_size):
        assert comm_check.mismatch(checked, rank, _own_inputs(checked, rank, model_file, meta)) is None


def test_graphs_at_new_sizes_hold_the_same_tensors(planned):
    plan, model_file, meta = planned
    replica, stage = plan.replicas[0], plan.replicas[0].stages[0]
    graphs = StageGraphs(meta, model_file, [s.last_node for s in replica.stages], replica.micro_batch_sizes,
                         lambda rows: data.meta_inputs(model_file, rows), CPU)
    values = materialise.materialise(meta, graphs.tensor_names(0) + list(stage.params), CPU)
    graphs.install(0, values)
    assert regraph(graphs, 0, (4,), model_file, CPU) is graphs          # every size traced already: kept
    grown = regraph(graphs, 0, (4, 4, 1), model_file, CPU)
    assert grown.sizes == [1, 4]
    module = grown.split_at(1).stages[0].module
    for name in stage.params:
        assert getattr(module, attr_name(name)) is values[name]     # the optimizer's parameters, not copies
    (x,), _ = frontend.example_batch_for_step(model_file, 1, 0)
    old_out = graphs.split_at(4).stages[0].module(torch.cat([x] * 4))
    new_out = module(x)
    torch.testing.assert_close(new_out[0] if isinstance(new_out, tuple) else new_out,
                               (old_out[0] if isinstance(old_out, tuple) else old_out)[:1])


# ----------------------------------------------------------------------------- agreeing on real gloo

TIMEOUT = datetime.timedelta(seconds=30)


def _agree_worker(rank: int, store_port: int, world_size: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        assert agree(None, rank, world_size, CPU) is None
        mine = "rank 1: its split differs" if rank == 1 else None
        got = agree(mine, rank, world_size, CPU)
        if rank == 1:
            assert got == mine
        else:
            assert got is not None and got.startswith("rank 1 could not verify"), got
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_rank_refusing_makes_every_rank_refuse():
    spawn_gloo_workers(_agree_worker, (2,), 2, deadline_s=60.0)
