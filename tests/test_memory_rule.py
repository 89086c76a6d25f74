"""One memory rule (costmodel.memory.fits) for the search, assembly and verify; compressor state is
priced by the search: a compressor whose state does not fit beside a stage is not chosen for it.

need = state + kept activations + framework (+ compressor state), capacity = memory x (1 - margin):
the split's dynamic programme and greedy test, the compressor choice and verify_plan all call the same
`fits`, the per-rank estimate is that need (with the calibrated framework figure the split used), and
a plan edited past the margin is refused.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from costmodel import constants as C
from costmodel import memory
from passes.verify import verify_plan
from planner.api import PlanOptions, plan
from planner.core.errors import PlanningError
from planner.core.ir import Plan
from planner.frontend.cluster import load_cluster
from planner.search import ilp
from planner.search.assemble import assemble
from planner.search.configs import build_configs
from planner.search.solver import SolverSettings
from tests.helpers import CLUSTERS, EXAMPLES
from tests.test_calibration import synthetic

GPT = EXAMPLES / "gpt" / "model.py"
CPU4 = CLUSTERS / "cpu-hetero-4.yaml"
# 2 replicas x 2 stages on the four CPUs: every gradient group spans two or four ranks
TWO_BY_TWO = dict(global_batch=16, use_all_devices=True, stages=2, runners_up=False)
ONEBIT_STATE_PER_FP32_BYTE = 2     # two error buffers (worker, server): one fp32 copy each


def _with_memory(spec, memory_bytes: int):
    """`spec` with every device type's memory set to `memory_bytes`."""
    nodes = tuple(dataclasses.replace(g, device=dataclasses.replace(g.device, memory_bytes=memory_bytes))
                  for g in spec.nodes)
    return dataclasses.replace(spec, nodes=nodes)


def _state_of(p: Plan, rank: int) -> float:
    """Compressor state a rank holds: 1-bit's for each of its 1-bit groups."""
    return sum(ONEBIT_STATE_PER_FP32_BYTE * g.nbytes for g in p.grad_groups
               if rank in g.ranks and g.compressor == "onebit")


def _config_of(tables, solution, replica):
    """The configuration of the solution a plan's replica runs: its device classes, cuts and micro-batch."""
    names = [t.name for t in tables.classes]
    classes = tuple(names.index(st.device_label.split("/")[0]) for st in replica.stages)
    bounds = (*(st.first_block for st in replica.stages), replica.stages[-1].last_block + 1)
    matches = {c.config for c in solution.choices if c.config.classes == classes and c.config.split.bounds == bounds}
    if len(matches) > 1:    # a share smaller than the micro-batch size runs one smaller micro-batch
        matches = {c for c in matches if c.micro_batch == replica.micro_batch_sizes[0]}
    (config,) = matches
    return config


@pytest.fixture(scope="module")
def roomy_onebit() -> Plan:
    """1-bit forced, margin 0, the CPUs' own 64 GiB: every group has the memory for its state."""
    return plan(GPT, CPU4, PlanOptions(**TWO_BY_TWO, compression="onebit", memory_margin=0.0)).plan


def test_compressor_state_is_in_each_ranks_memory_where_it_fits(roomy_onebit):
    p = roomy_onebit
    assert {g.compressor for g in p.grad_groups} == {"onebit"}
    for g in p.grad_groups:
        assert g.settings is not None and g.settings.warmup_fraction > 0   # 1-bit Adam's warm-up recorded
    for rank in range(p.world_size):
        assert _state_of(p, rank) > 0


def test_onebit_state_that_does_not_fit_a_nearly_full_device_is_not_chosen(roomy_onebit):
    """The device holds the fullest stage and 100 kB more, less than that stage's 1-bit state: that
    stage's groups sync exactly, the others keep 1-bit, and every rank's recorded memory (state
    included) fits by the rule verify applies. (Before, assembly added the state after the memory
    check and the plan failed verify.)"""
    needs = [m - _state_of(roomy_onebit, r) for r, m in enumerate(roomy_onebit.estimates.memory_bytes)]
    tight = int(max(needs) + 100_000)
    fullest = needs.index(max(needs))
    assert _state_of(roomy_onebit, fullest) > 100_000          # its state does not fit: the test's premise
    spec = _with_memory(load_cluster(CPU4), tight)
    result = plan(GPT, spec, PlanOptions(**TWO_BY_TWO, compression="onebit", memory_margin=0.0))
    p = result.plan
    verify_plan(p, spec)
    assert all(m <= tight for m in p.estimates.memory_bytes)
    refused = [g for g in p.grad_groups if g.compressor == "none"]
    kept = [g for g in p.grad_groups if g.compressor == "onebit"]
    assert refused and kept                                    # some stages had the room, some not
    for g in refused:                  # refused for memory: some member could not have held the state
        assert g.settings is None
        assert any(p.estimates.memory_bytes[r] + ONEBIT_STATE_PER_FP32_BYTE * g.nbytes > tight for r in g.ranks)
    # the decision is the search's: each stage's configuration says which compressors fit it, and a
    # group is 1-bit exactly where every member's does (assembly of the re-solved search is the plan)
    configs = build_configs(result.tables, 2, None)
    solution = ilp.solve(result.tables, configs, SolverSettings(work_limit_s=10.0), use_all_devices=True)
    assert assemble(solution=solution, tables=result.tables, blocks=result.blocks, spec=spec, inputs=p.inputs,
                    strategy="ilp") == p
    room = {}
    for replica in p.replicas:
        config = _config_of(result.tables, solution, replica)
        room.update({st.rank: config.stage_compressors[st.index] for st in replica.stages})
    for g in p.grad_groups:
        assert (g.compressor == "onebit") == all("onebit" in room[r] for r in g.ranks)
    # what verify accepts is what the search planned for: the plan's own margin (0 here) is recorded
    assert p.estimates.memory_margin == 0.0 and json.loads(p.to_json())["estimates"]["memory_margin"] == 0.0


def test_verify_refuses_a_plan_edited_past_the_margin():
    """verify compares with memory x (1 - margin), the capacity the search planned with (it used to
    compare with the raw memory: a plan over the margin passed)."""
    spec = load_cluster(CPU4)
    p = plan(GPT, spec, PlanOptions(global_batch=8, runners_up=False)).plan
    assert p.estimates.memory_margin == pytest.approx(0.1)
    assert "memory_margin" not in json.loads(p.to_json())["estimates"]   # the default is not written
    capacity = memory.capacity_bytes(p.estimates.capacity_bytes[0], p.estimates.memory_margin)

    def with_rank0(nbytes: float) -> Plan:
        mem = (nbytes, *p.estimates.memory_bytes[1:])
        return dataclasses.replace(p, estimates=dataclasses.replace(p.estimates, memory_bytes=mem))

    verify_plan(with_rank0(capacity), spec)                    # exactly at the margin: fits
    over = with_rank0(capacity * (1 + 1e-9))
    assert over.estimates.memory_bytes[0] < over.estimates.capacity_bytes[0]   # within the raw memory
    with pytest.raises(PlanningError, match="margin"):
        verify_plan(over, spec)
    # a plan file read back keeps its margin: a plan made with a larger one is judged by it
    wide = dataclasses.replace(p, estimates=dataclasses.replace(p.estimates, memory_margin=0.999))
    with pytest.raises(PlanningError):
        verify_plan(Plan.from_json(wide.to_json()), spec)


def test_split_compressor_choice_and_verify_call_the_one_rule(monkeypatch):
    """Record who asks `costmodel.memory.fits`: the split (DP, greedy test, per-stage recompute), the
    GPipe limit, the compressors' room and verify all do; no one compares memory by other means
    (a stricter rule swapped in is what verify then applies to the search's own plan)."""
    callers: set[str] = set()
    rule = memory.fits

    def recording(need, capacity):
        callers.add(sys._getframe(1).f_globals["__name__"])
        return rule(need, capacity * 0.999)       # a slightly stricter rule, seen by every caller alike
    monkeypatch.setattr(memory, "fits", recording)
    result = plan(GPT, CPU4, PlanOptions(global_batch=16, compression="onebit", schedule="auto",
                                         runners_up=False))
    assert {"planner.search.split", "planner.search.schedules", "planner.search.align",
            "costmodel.compression_memory", "passes.verify"} <= callers
    for m, device_bytes in zip(result.plan.estimates.memory_bytes, result.plan.estimates.capacity_bytes):
        assert m <= memory.capacity_bytes(device_bytes, 0.1) * 0.999


def test_recorded_memory_is_the_need_the_split_checked_with_the_calibrated_framework(tmp_path):
    """With a calibration the framework figure is the measured one (300 MiB here, against ~420 MiB of
    datasheet; on CPU with the program steps' own C.CPU_PROGRAM_STEP_BYTES): the split planned with it,
    and the plan records it (assembly used to add the datasheet figure after the check)."""
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps(synthetic()))
    result = plan(GPT, CPU4, PlanOptions(global_batch=8, calibration=str(cal), runners_up=False))
    p, tables = result.plan, result.tables
    # the measured framework with what the CPU program's steps add to it, and the largest gradient's
    # transient the framework share holds beside it
    largest = max(s for b in result.blocks for s in b.param_sizes)
    measured = 300 * 2**20 + C.CPU_PROGRAM_STEP_BYTES + memory.gradient_transient_bytes(largest)
    for replica in p.replicas:
        S, M = len(replica.stages), len(replica.micro_batch_sizes)
        for st in replica.stages:
            table = next(t for t in tables.classes if t.device_type == st.device_type)
            assert table.framework_bytes == measured
            blocks = range(st.first_block, st.last_block + 1)
            in_flight = memory.in_flight_micro_batches(replica.schedule, st.index, S, M)
            rows = replica.micro_batch_sizes[0]
            state = table.held_state_bytes([blocks])           # the tied embedding once
            act = sum(table.act_bytes[b] for b in blocks) * rows * in_flight
            act += max(table.transient_bytes[b] for b in blocks) * rows       # one micro-batch's backward
            assert not st.recompute
            assert p.estimates.memory_bytes[st.rank] == pytest.approx(state + act + measured, rel=1e-12)
