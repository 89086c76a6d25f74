"""CPU compute is priced for the processes a plan puts on the host, not for the `--concurrency` the
profile ran: a profile of 4 processes on this host prices a 2-process plan by its own share of a core."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from costmodel.calibration import parse_calibration
from costmodel.host_sharing import contention_factor, for_spec, host_processes, priced_for, priced_process_notes
from costmodel.tables import build_tables
from planner import frontend
from planner.api import DEFAULT_TRACE_BATCH, PlanOptions, RunControls, plan, trace_model_file
from planner.estimate import estimate, merge_options
from planner.frontend.cluster import load_cluster
from planner.frontend.layout import load_layout
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli
from tests.test_calibration import synthetic

MLP = EXAMPLES / "mlp" / "model.py"
HETERO = CLUSTERS / "cpu-hetero-4.yaml"
TWO = """name: cpu-2
devices:
  cpu-a: {base: CPU, slowdown: 1.0}
nodes:
  - {name: cpu, count: 1, device: cpu-a, per_node: 2, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""
FOUR = TWO.replace("cpu-2", "cpu-4").replace("per_node: 2", "per_node: 4")


def _doc(processes: int, cores: int, factor: float) -> dict:
    doc = copy.deepcopy(synthetic())
    doc["device"]["concurrent_processes"] = processes
    doc["host_sharing"] = {"processes": processes, "cores": cores, "usable_cores": cores,
                           "contention_factor": factor}
    return doc


@pytest.fixture(scope="module")
def mlp_blocks():
    _, blocks, _ = trace_model_file(frontend.load_model_file(MLP))
    return blocks


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("specs")
    (folder / "two.yaml").write_text(TWO)
    (folder / "four.yaml").write_text(FOUR)
    return {n: load_cluster(folder / f"{name}.yaml") for n, name in ((2, "two"), (4, "four"))}


def _compute_s(blocks, spec, calibration) -> float:
    table = build_tables(blocks, spec, global_batch=16, trace_batch=DEFAULT_TRACE_BATCH,
                         calibration=calibration).classes[0]
    return sum(table.fwd_s) + sum(table.bwd_s) + sum(table.overhead_s)


def test_the_factor_follows_processes_against_cores():
    oversubscribed = parse_calibration(_doc(4, 2, 2.0))           # 4 workers on 2 cores: half a core each
    assert [contention_factor(n, oversubscribed) for n in (1, 2, 4, 8)] == [1.0, 1.0, 2.0, 4.0]
    spare = parse_calibration(_doc(1, 4, 1.1))                    # 1 worker of 4 cores: beyond it, the cores
    assert [contention_factor(n, spare) for n in (1, 4, 8)] == [1.1, 1.1, 2.0]
    assert parse_calibration(_doc(4, 2, 2.0)).contention_factor == 2.0    # loaded: the profile's own count


def test_the_spec_says_how_many_processes_share_the_host(specs):
    cal = parse_calibration(_doc(4, 2, 2.0))
    assert host_processes(load_cluster(HETERO), cal) == 4           # loopback: both node groups, one host
    assert host_processes(specs[2], cal) == 2
    assert for_spec(cal, specs[2]).contention_factor == 1.0 and for_spec(cal, specs[4]) == cal
    assert for_spec(None, specs[2]) is None


def test_a_two_process_plan_is_priced_at_its_own_share(mlp_blocks, specs):
    cal = parse_calibration(_doc(4, 2, 2.0))
    as_profiled = _compute_s(mlp_blocks, specs[2], cal)             # what the profile's count gave before
    two, four = (_compute_s(mlp_blocks, specs[n], for_spec(cal, specs[n])) for n in (2, 4))
    assert two == pytest.approx(as_profiled / 2) and four == pytest.approx(as_profiled)
    # links were timed in wall seconds: unchanged by the processes' share of a core
    priced = build_tables(mlp_blocks, specs[2], global_batch=16, trace_batch=DEFAULT_TRACE_BATCH,
                          calibration=for_spec(cal, specs[2]))
    assert priced.classes[0].intra_latency_s == cal.p2p.latency_s


def test_a_plan_running_fewer_processes_than_priced_says_so(specs, tmp_path):
    cal_file = tmp_path / "cal.json"
    cal_file.write_text(json.dumps(_doc(4, 2, 2.0)))
    two = plan(MLP, specs[2], PlanOptions(global_batch=16, runners_up=False, calibration=str(cal_file)),
               RunControls()).plan
    cal = parse_calibration(_doc(4, 2, 2.0))
    assert priced_process_notes(two, specs[2], for_spec(cal, specs[2])) == ()
    (note,) = priced_process_notes(two, specs[2], priced_for(cal, 4))
    assert "priced for 4 processes" in note and f"runs {two.world_size}" in note and "2.00x" in note


@pytest.mark.slow
def test_a_real_profile_at_concurrency_4_prices_plans_of_2_and_4(tmp_path, mlp_blocks, specs):
    out = tmp_path / "calibration.json"
    proc = run_plan_cli("profile", "--quick", "--concurrency", "4", "--out", str(out), timeout_s=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    from costmodel.calibration import load_calibration

    cal = load_calibration(out)
    sharing = doc["host_sharing"]
    assert sharing["usable_cores"] == cal.host_cores and cal.concurrent_processes == 4
    two, four = (for_spec(cal, specs[n]) for n in (2, 4))
    assert four.contention_factor == pytest.approx(sharing["contention_factor"])
    expected_two = (max(1.0, 2 * sharing["contention_factor"] / 4) if cal.host_cores <= 4
                    else max(sharing["contention_factor"], 2 / cal.host_cores))
    assert two.contention_factor == pytest.approx(expected_two)
    ratio = _compute_s(mlp_blocks, specs[2], two) / _compute_s(mlp_blocks, specs[4], four)
    assert ratio == pytest.approx(two.contention_factor / four.contention_factor)
    if cal.host_cores <= 2:     # 4 workers on 2 cores share them: a 2-process plan is priced well faster
        assert ratio < 0.8


def test_plan_prices_the_calibration_for_the_spec(mlp_blocks, specs, tmp_path):
    cal_file = tmp_path / "cal.json"
    cal_file.write_text(json.dumps(_doc(4, 2, 2.0)))
    result = plan(MLP, specs[2], PlanOptions(global_batch=16, runners_up=False, calibration=str(cal_file)),
                  RunControls())
    table = result.tables.classes[0]
    as_profiled = _compute_s(mlp_blocks, specs[2], parse_calibration(_doc(4, 2, 2.0)))
    assert sum(table.fwd_s) + sum(table.bwd_s) + sum(table.overhead_s) == pytest.approx(as_profiled / 2)


def _three(tmp_path) -> Path:
    """A 3-process loopback spec: two cpu-a devices on one node, a slower cpu-b on another."""
    three = tmp_path / "three.yaml"
    three.write_text(TWO.replace("cpu-2", "cpu-3").replace(
        "  - {name: cpu, count: 1, device: cpu-a, per_node: 2, intra_link: shm}",
        "  - {name: cpu, count: 1, device: cpu-a, per_node: 2, intra_link: shm}\n"
        "  - {name: slow, count: 1, device: cpu-b, per_node: 1, intra_link: shm}").replace(
        "  cpu-a: {base: CPU, slowdown: 1.0}",
        "  cpu-a: {base: CPU, slowdown: 1.0}\n  cpu-b: {base: CPU, slowdown: 3.0}"))
    return three


def test_a_plan_leaving_devices_idle_is_priced_for_the_processes_it_runs(specs, tmp_path):
    """The `fastest` baseline on cpu-4 (synthetic profile of 4 workers on 2 cores) runs on 2 of its 4
    devices: its estimate is the one of the same plan made on a 2-device spec, not the 4-process price
    the search first gave it, and it says nothing about being priced for another count."""
    cal_file = tmp_path / "cal.json"
    cal_file.write_text(json.dumps(_doc(4, 2, 2.0)))
    three = _three(tmp_path)      # 3 processes: the fastest devices are the 2 of the first node
    options = PlanOptions(global_batch=16, runners_up=False, calibration=str(cal_file), strategy="fastest",
                          stages=1)
    idle = plan(MLP, load_cluster(three), options, RunControls()).plan
    alone = plan(MLP, specs[2], options, RunControls()).plan
    assert idle.world_size == alone.world_size == 2
    assert idle.estimates.iteration_s == pytest.approx(alone.estimates.iteration_s, rel=1e-9)
    assert not any("priced for" in w for w in idle.warnings)
    # its stages name the devices of the whole spec (indices by label), as every plan of it does
    devices = {d.label: d.index for d in load_cluster(three).devices()}
    assert all(devices[s.device_label] == s.device for r in idle.replicas for s in r.stages)
    # priced at the spec's 3 processes (factor 1.5) it would have been slower
    at_three = for_spec(parse_calibration(_doc(4, 2, 2.0)), load_cluster(three))
    assert at_three.contention_factor == pytest.approx(1.5)


def test_an_all_device_plan_is_priced_once(specs, tmp_path):
    cal_file = tmp_path / "cal.json"
    cal_file.write_text(json.dumps(_doc(4, 2, 2.0)))
    result = plan(MLP, specs[4], PlanOptions(global_batch=16, runners_up=False, calibration=str(cal_file),
                                            use_all_devices=True), RunControls())
    assert result.plan.world_size == 4 and not any("priced for" in w for w in result.plan.warnings)


def test_a_given_layout_on_part_of_the_spec_is_priced_for_its_processes(specs, tmp_path):
    """`plan estimate --layout` of 2 replicas on the 2 cpu-a devices of the 3-device spec estimates what
    the same layout does on the 2-device spec: priced for the 2 processes it runs."""
    cal_file = tmp_path / "cal.json"
    cal_file.write_text(json.dumps(_doc(4, 2, 2.0)))
    options = PlanOptions(global_batch=16, calibration=str(cal_file))
    layout = load_layout("dp=2,tp=1,pp=1,mb=8")
    part = estimate(MLP, load_cluster(_three(tmp_path)), layout, merge_options(layout, options, set())).plan
    whole = estimate(MLP, specs[2], layout, merge_options(layout, options, set())).plan
    assert part.world_size == whole.world_size == 2
    assert part.estimates.iteration_s == pytest.approx(whole.estimates.iteration_s, rel=1e-9)
    assert not any("priced for" in w for w in part.warnings)
