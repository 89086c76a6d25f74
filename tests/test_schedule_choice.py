"""The search chooses each replica's pipeline schedule (1F1B, GPipe or interleaved 1F1B) by its exact time,
within memory."""

from __future__ import annotations

import random

import pytest

from backends.sim.engine import simulate
from backends.sim.inputs import ReplicaWork, SimInput, StageWork
from planner.search import ilp, pipeline
from planner.search.configs import build_configs
from planner.search.enumerate import solve_exact
from planner.search.schedules import gpipe_max_micro_batches
from tests import synthetic as syn
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli
from tests.test_pipeline_time import random_pipeline, simulated_s

GIB = syn.GIB


@pytest.mark.parametrize("seed", range(3))
def test_gpipe_makespans_equal_the_simulated_schedule(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(40):
        fwd, bwd, send = random_pipeline(rng, 9)
        most = rng.randint(1, 24)
        got = pipeline.gpipe_makespans_s(tuple(fwd), tuple(bwd), tuple(send), most)
        for M in range(1, most + 1):
            assert got[M] == pytest.approx(simulated_s(fwd, bwd, send, M, "gpipe"), rel=1e-12), (fwd, bwd, send, M)


def test_gpipe_streams_transfers_that_1f1b_alternates_with_compute() -> None:
    """Two stages, forward = backward = transfer = 1: GPipe's forwards and backwards each stream
    through stage, link, stage (2 * (3 + M - 1)); 1F1B makes every backward wait on a transfer."""
    for M in (8, 32):
        assert pipeline.pipeline_s((1.0, 1.0), (1.0, 1.0), (1.0,), M, "gpipe") == pytest.approx(2 * (M + 2))
        assert pipeline.pipeline_s((1.0, 1.0), (1.0, 1.0), (1.0,), M) > 2 * (M + 2) + 1.0


def _two_node_pipeline(act_gib: float, capacity_gib: float, global_batch: int):
    """A model that must be cut in two (8 GiB of state, 6 GiB devices) across two one-device nodes,
    its activations as large on the wire as its compute is long."""
    t = syn.table("a", 1.0, blocks=8, devices=2, per_node=1, capacity_gib=capacity_gib, block_s=[2e-3] * 8,
                  boundary_bytes=2e7, act_gib=act_gib)
    return syn.tables([t], global_batch, inter_gbit_s=100.0)


def test_search_picks_gpipe_where_it_is_faster_and_its_time_is_the_simulated_one() -> None:
    tabs = _two_node_pipeline(act_gib=0.01, capacity_gib=6.0, global_batch=16)
    only_1f1b = ilp.solve(tabs, build_configs(tabs, schedule="1f1b"))
    auto = ilp.solve(tabs, build_configs(tabs))
    assert {c.config.schedule for c in auto.choices} == {"gpipe"}
    assert auto.objective_s < 0.9 * only_1f1b.objective_s
    (choice,) = auto.choices
    sp, M = choice.config.split, choice.share // choice.config.micro_batch
    assert M <= choice.config.max_micro_batches
    simulated = simulated_s(list(sp.fwd_s), list(sp.bwd_s), list(sp.send_s), M, "gpipe")
    assert auto.pipeline_s == pytest.approx(simulated + choice.config.optimizer_s, rel=1e-6)
    # the exact enumerator, over the same space, agrees
    assert solve_exact(tabs, build_configs(tabs)).objective_s == pytest.approx(auto.objective_s, rel=1e-6)


def test_gpipe_runs_only_as_many_micro_batches_as_its_stages_hold() -> None:
    """1 GiB of activations per block and sample: GPipe's first stage holds its 4 GiB of state and
    two one-sample micro-batches (4 GiB each) in 12.5 GiB, where a 16-sample batch needs 16; at two
    samples per micro-batch the first stage recomputes and the last holds one micro-batch. 1F1B
    serves the batch, GPipe cannot."""
    tabs = _two_node_pipeline(act_gib=1.0, capacity_gib=12.5, global_batch=16)
    capacity = tabs.classes[0].capacity_bytes
    configs = build_configs(tabs, schedule="gpipe")
    plain = [c for c in configs if not c.split.recompute]
    assert [c.micro_batch for c in plain] == [1]
    for c in plain:
        per_micro = 4 * GIB * c.micro_batch              # each stage: 4 blocks x 1 GiB x micro-batch
        assert c.max_micro_batches == gpipe_max_micro_batches(tabs, c) == 2
        assert 4 * GIB + 2 * per_micro <= capacity < 4 * GIB + 3 * per_micro
    assert {c.config.schedule for c in ilp.solve(tabs, build_configs(tabs)).choices} == {"1f1b"}
    assert ilp.solve(tabs, configs) is None


def test_forcing_a_schedule_keeps_only_its_configurations() -> None:
    tabs = _two_node_pipeline(act_gib=0.01, capacity_gib=6.0, global_batch=16)
    assert {c.schedule for c in build_configs(tabs, schedule="1f1b")} == {"1f1b"}
    assert {c.schedule for c in build_configs(tabs, schedule="gpipe")} == {"gpipe"}
    assert {c.schedule for c in build_configs(tabs, schedule="interleaved")} == {"interleaved"}
    assert {c.schedule for c in build_configs(tabs)} == {"1f1b", "gpipe", "interleaved"}


def test_forced_stages_beyond_the_devices_interleave() -> None:
    """`--stages 4` on two devices: no 1F1B pipeline of 4 stages exists, two devices of two chunks do,
    at the micro-batch sizes offered (where the devices hold the schedule's activations)."""
    tabs = _two_node_pipeline(act_gib=0.01, capacity_gib=6.0, global_batch=16)
    forced = build_configs(tabs, fixed_stages=4, schedule="interleaved")
    assert forced and {(c.num_stages, c.chunks, len(c.device_classes)) for c in forced} == {(4, 2, 2)}
    sizes = {c.micro_batch for c in forced}
    assert len(sizes) > 1 and sizes <= {c.micro_batch for c in build_configs(tabs, fixed_stages=2)}


def test_an_unknown_schedule_is_refused_before_tracing() -> None:
    from planner.api import PlanOptions, plan
    from planner.core.errors import OptionError

    with pytest.raises(OptionError) as err:
        plan("no-such-model.py", "no-such-cluster.yaml", PlanOptions(schedule="zigzag"))
    assert err.value.field == "--schedule" and "auto, 1f1b, gpipe" in err.value.fix


def test_search_picks_interleaving_where_the_fill_dominates_and_its_time_is_the_simulated_one() -> None:
    """Eight blocks on two devices of one node, four one-sample micro-batches: 1F1B's fill is a whole
    device's stage, interleaved 1F1B's a chunk's. The search takes the interleaved replica, priced as the
    simulator runs it, and the exact enumerator agrees."""
    t = syn.table("a", 1.0, blocks=8, devices=2, per_node=2, capacity_gib=40.0, block_s=[2e-3] * 8,
                  boundary_bytes=1e5, act_gib=0.01)
    tabs = syn.tables([t], 4, inter_gbit_s=100.0)
    only_1f1b = ilp.solve(tabs, build_configs(tabs, schedule="1f1b"))
    auto = ilp.solve(tabs, build_configs(tabs))
    chosen = {(c.config.schedule, c.config.chunks) for c in auto.choices}
    assert {schedule for schedule, _ in chosen} == {"interleaved"} and all(v > 1 for _, v in chosen)
    assert auto.objective_s < 0.9 * only_1f1b.objective_s
    for choice in auto.choices:
        c = choice.config
        sp = c.split
        stages = tuple(StageWork(k % len(c.device_classes), (sp.fwd_s[k],) * 4, (sp.bwd_s[k],) * 4,
                                 (sp.send_s[k],) * 4 if k + 1 < c.num_stages else (),
                                 (sp.send_s[k - 1],) * 4 if k else (), 0.0) for k in range(c.num_stages))
        simulated = simulate(SimInput(2, 4, (ReplicaWork(0, "interleaved", stages, c.chunks),), ()),
                             timeline=False).pipeline_s
        assert c.replica_time_s(choice.share // c.micro_batch) == pytest.approx(simulated + c.optimizer_s, rel=1e-9)
    assert solve_exact(tabs, build_configs(tabs)).objective_s == pytest.approx(auto.objective_s, rel=1e-6)


def test_a_stage_count_that_cannot_interleave_is_named(tmp_path) -> None:
    """Two stages cannot interleave (two devices holding two stages each is the least): the command says
    so on --stages, not that the model fits nowhere."""
    proc = run_plan_cli(str(EXAMPLES / "mlp" / "model.py"), "--cluster", str(CLUSTERS / "cpu-4.yaml"),
                        "--schedule", "interleaved", "--stages", "2", "-o", str(tmp_path / "out"))
    assert proc.returncode != 0
    line = proc.stderr.strip().splitlines()[-1]
    assert "--stages" in line and "cannot interleave" in line and "even number of stages from 4" in line
    assert not (tmp_path / "out").exists()
