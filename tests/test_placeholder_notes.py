"""A plan costed from the catalog's placeholder figures says so (its warnings, a head line of its summary),
naming the device type and `plan profile`; a calibration of the type, or figures the spec gives, silence it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from backends.report.terminal import summary
from costmodel.calibration import load_calibration, to_json
from costmodel.catalog import load_catalog
from costmodel.cost_notes import cost_notes
from costmodel.placeholders import NOTE_PREFIX, noted_device_type, placeholder_entry
from planner.api import PlanOptions, RunControls, plan
from planner.frontend.cluster import load_cluster
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli
from tests.test_calibration import synthetic

MLP = EXAMPLES / "mlp" / "model.py"
HETERO = CLUSTERS / "cpu-hetero-4.yaml"
OPTIONS = dict(global_batch=16, runners_up=False)


@pytest.fixture(scope="module")
def uncalibrated():
    return plan(MLP, HETERO, PlanOptions(**OPTIONS), RunControls()).plan


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calibration.json"
    path.write_text(to_json(synthetic()))
    return path


def test_the_catalog_marks_the_cpu_entry_and_no_datasheet_entry():
    catalog = load_catalog()
    assert placeholder_entry(catalog["CPU"], catalog) is catalog["CPU"]
    assert all(placeholder_entry(d, catalog) is None for name, d in catalog.items() if name != "CPU")


def test_an_uncalibrated_plan_on_cpu_hetero_4_says_so(uncalibrated):
    notes = cost_notes(uncalibrated, load_cluster(HETERO), None)
    used = {st.device_type for r in uncalibrated.replicas for st in r.stages}
    assert notes and {noted_device_type(n) for n in notes} == used
    for note in notes:
        assert note.startswith(NOTE_PREFIX) and "`plan profile" in note and "--calibration" in note
    # the summary's head names the types and the command, as `planner.api` stores the notes in `warnings`
    head = summary(dataclasses.replace(uncalibrated, warnings=notes), width=None).split("\n\n")[0]
    line = next(ln for ln in head.splitlines() if ln.startswith("estimates from placeholder figures"))
    assert all(t in line for t in used) and "plan profile" in line
    assert "placeholder" not in summary(dataclasses.replace(uncalibrated, warnings=()), width=None)


def test_a_calibration_of_the_type_silences_it(uncalibrated, calibration_file):
    assert cost_notes(uncalibrated, load_cluster(HETERO), load_calibration(calibration_file)) == ()
    other = load_calibration(calibration_file)
    assert cost_notes(uncalibrated, load_cluster(HETERO), dataclasses.replace(other, device_name="H200"))


def test_figures_the_spec_gives_are_not_placeholders(tmp_path):
    spec = tmp_path / "own.yaml"
    spec.write_text(HETERO.read_text().replace("{base: CPU, slowdown: 1.0}",
                                               "{base: CPU, slowdown: 1.0, peak_tflops: {fp32: 0.02}}"))
    catalog = load_catalog()
    fast, slow = (g.device for g in load_cluster(spec).nodes)
    assert placeholder_entry(fast, catalog) is None and placeholder_entry(slow, catalog) is catalog["CPU"]


@pytest.mark.slow
def test_plan_json_and_summary_say_so_without_a_calibration_only(tmp_path, calibration_file):
    for name, extra in (("plain", ()), ("calibrated", ("--calibration", str(calibration_file)))):
        proc = run_plan_cli(str(MLP), "--cluster", str(HETERO), "--global-batch", "16", "--no-runners-up",
                            "-o", str(tmp_path / name), *extra, timeout_s=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
    plain = json.loads((tmp_path / "plain" / "plan.json").read_text())["warnings"]
    assert any(noted_device_type(w) == "cpu-fast" for w in plain)
    assert "estimates from placeholder figures" in (tmp_path / "plain" / "summary.txt").read_text()
    calibrated = json.loads((tmp_path / "calibrated" / "plan.json").read_text()).get("warnings", [])
    assert not any(noted_device_type(w) for w in calibrated)
