"""Recompute inside interleaved 1F1B: where interleaving is asked for, a device whose stages do not fit
recomputes all of them (and only such a device); its memory is its stages' inputs per micro-batch in flight
plus one stage's activations; the open search offers no such twin; such a plan's own layout estimates back
to it; and a plan where one device recomputes trains as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.api import PhaseTimer, PlanOptions, plan
from planner.core import schedule as sched
from planner.core.ir import Plan
from planner.estimate import Prepared, estimate_prepared, merge_options
from planner.frontend.layout import load_layout
from planner.search.configs import build_configs
from planner.search.interleave_configs import interleaved
from planner.search.split import block_phases_s
from tests import synthetic as syn
from tests.helpers import EXAMPLES, run_plan_cli
from tests.test_e2e import _check_against_reference
from tests.test_layout_estimate import ILP_CLOCK_S
from tests.test_recompute import SPEC

GIB = 2**30
BOUNDARY_BYTES = 1e6
ACT_GIB = 1.0              # per block and sample


def _tables(capacity_gib: float):
    """8 equal blocks of 1 GiB state and 1 GiB activations per sample on 2 devices of one node."""
    t = syn.table("a", 1.0, blocks=8, devices=2, per_node=2, capacity_gib=capacity_gib, state_gib=[1.0] * 8,
                  act_gib=ACT_GIB, boundary_bytes=BOUNDARY_BYTES)
    return syn.tables([t], global_batch=8)


def _most_in_flight(device: int) -> int:
    """The most micro-batches device `device` of 2 x 2 chunks holds forwarded and not yet backwarded, walking
    the schedule's own actions (4 rounds: its warm-up whole)."""
    live = most = 0
    for action in sched.interleaved(2, 2, 8)[device]:
        live += 1 if action.kind == "F" else -1
        most = max(most, live)
    return most


def test_only_the_device_that_does_not_fit_recomputes_and_its_memory_is_inputs_plus_one_stage():
    # 2 devices x 2 chunks, 2 blocks a stage: a device's state is 4 GiB; device 0 keeps more micro-batches
    # in flight than device 1, each holding its stage's 2 GiB of activations
    held = [_most_in_flight(d) for d in range(2)]
    assert held[0] > held[1]
    plain = [4 + 2 * ACT_GIB * n for n in held]                       # GiB, every block's activations kept
    capacity = (plain[0] + plain[1]) / 2                              # device 1 fits, device 0 does not
    tables = _tables(capacity)
    assert interleaved(tables, 0, 2, 2, 1, recompute=False) is None
    config = interleaved(tables, 0, 2, 2, 1, recompute=True)
    assert config is not None and config.split.bounds == (0, 2, 4, 6, 8)
    assert config.split.stage_recompute == (True, False, True, False)      # stage k on device k mod 2
    table = tables.classes[0]
    recomputed = 4 * GIB + held[0] * BOUNDARY_BYTES + 2 * ACT_GIB * GIB      # inputs in flight + one stage
    assert config.split.stage_memory_bytes[0] == pytest.approx(recomputed + table.framework_bytes, rel=1e-12)
    assert config.split.stage_memory_bytes[1] == pytest.approx(plain[1] * GIB + table.framework_bytes, rel=1e-12)
    for k in range(4):      # the recomputing device's stages run their forward again inside the backward
        fwd, bwd = block_phases_s(table, range(2 * k, 2 * k + 2), 1, k % 2 == 0)
        assert (config.split.fwd_s[k], config.split.bwd_s[k]) == pytest.approx((fwd, bwd), rel=1e-12)
    assert config.split.bwd_s[0] > config.split.bwd_s[1]


def test_the_open_search_offers_no_recomputing_twin_and_interleaving_asked_for_does():
    held = [_most_in_flight(d) for d in range(2)]
    capacity = 4 + 2 * ACT_GIB * held[1] + 0.5            # device 1 of a twin fits, device 0 does not
    assert 4 + 2 * ACT_GIB * held[0] > capacity
    tables = _tables(capacity)
    offered = build_configs(tables, fixed_micro_batch=1)
    assert any(c.schedule == "1f1b" and c.num_stages == 2 for c in offered)     # the twins' parent
    assert not any(c.schedule == "interleaved" for c in offered)
    asked = build_configs(tables, fixed_micro_batch=1, schedule="interleaved")
    twins = [c for c in asked if c.schedule == "interleaved" and c.num_stages == 4]
    assert twins and all(c.split.stage_recompute == (True, False, True, False) for c in twins)


GPT = EXAMPLES / "gpt" / "model.py"
FLAGS = dict(global_batch=16, stages=4, micro_batch=2, memory_margin=0.0)


def _tight_spec(tmp_path: Path) -> Path:
    """Two CPU devices 1 KiB short of what device 0 of GPT in 4 interleaved stages needs to keep its
    in-flight micro-batches (device 1 keeps fewer and fits)."""
    roomy = tmp_path / "roomy.yaml"
    roomy.write_text(SPEC.format(memory_gib=64.0))
    needs = plan(GPT, roomy, PlanOptions(**FLAGS, schedule="interleaved", runners_up=False)).plan.estimates.memory_bytes
    assert needs[0] > needs[1] + 2048
    tight = tmp_path / "tight.yaml"
    tight.write_text(SPEC.format(memory_gib=(needs[0] - 1024) / 2**30))
    return tight


def test_a_recomputing_interleaved_plans_own_layout_estimates_to_the_plan(tmp_path):
    planned = plan(GPT, _tight_spec(tmp_path), PlanOptions(**FLAGS, schedule="interleaved", runners_up=False))
    original = planned.plan
    assert [s.recompute for s in original.replicas[0].stages] == [True, False, True, False]
    original.save(tmp_path / "plan.json")
    layout = load_layout(str(tmp_path / "plan.json"))
    prepared = Prepared(planned.cluster, planned.model_file, planned.graph, planned.blocks,  # type: ignore[arg-type]
                        planned.tables, PhaseTimer(), {})
    again = estimate_prepared(prepared, layout, merge_options(layout, PlanOptions(runners_up=False), set())).plan
    assert again.replicas == original.replicas
    assert again.estimates.memory_bytes == original.estimates.memory_bytes
    assert abs(again.estimates.iteration_s - original.estimates.iteration_s) <= ILP_CLOCK_S


@pytest.mark.slow
def test_an_interleaved_pipeline_whose_first_device_recomputes_trains_as_one_process(tmp_path):
    """GPT in 4 stages on 2 devices, the devices' memory 1 KiB short of what device 0 needs without
    recompute: device 0 recomputes its two stages, device 1 does not."""
    out = tmp_path / "out"
    proc = run_plan_cli(str(GPT), "--cluster", str(_tight_spec(tmp_path)), "--global-batch", "16",
                        "--stages", "4", "--micro-batch", "2", "--memory-margin", "0",
                        "--schedule", "interleaved", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    planned = Plan.load(out)
    assert [(r.schedule, r.chunks) for r in planned.replicas] == [("interleaved", 2)]
    assert [s.recompute for s in planned.replicas[0].stages] == [True, False, True, False]
    assert all(m <= c for m, c in zip(planned.estimates.memory_bytes, planned.estimates.capacity_bytes))
    _check_against_reference(out, planned, "gpt")
