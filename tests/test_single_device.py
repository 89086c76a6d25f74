"""The single-device fidelity benchmark (`benchmarks/fidelity.py --single-device`): one quick run on CPU
(quick profile of this machine, ops and blocks of the mlp example) checked for what it must hold; the
error paths and the calibration it predicts with, in-process."""

from __future__ import annotations

import copy
import json
import math
import sys

import pytest

from benchmarks import single_device
from benchmarks.fidelity import main as fidelity_main
from costmodel.calibration import load_calibration
from planner import frontend
from planner.api import trace_model_file
from planner.cli import main as plan_main
from planner.profiling import blockbench
from tests.helpers import EXAMPLES, REPO
from tests.test_calibration import synthetic

MLP = EXAMPLES / "mlp" / "model.py"
# Generous guards, not accuracy targets (benchmarks/fidelity.py --single-device measures those): this run
# profiles and measures on a host that the suite's other worker loads meanwhile. Under that load a held-out
# op once measured 3.1x its calibrated time (gelu 1000x96, 2026-12-02) and the whole mlp 2.1x (2026-12-03).
# What tells a calibration from none does not depend on the load: each held-out op's calibrated time is
# nearer its measurement than the datasheet's placeholder (1 TFLOP/s, 4-20x too fast here) is.
HELD_OUT_FACTOR = 6.0
WHOLE_MODEL_FACTOR = 4.0
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`fidelity.py --single-device --quick --models mlp` on CPU, profiling now (no --calibration)."""
    import subprocess

    out = tmp_path_factory.mktemp("single_device") / "single_device_cpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fidelity.py"), "--single-device", "--device",
                           "cpu", "--quick", "--models", "mlp", "--out", str(out)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_every_block_and_the_whole_model_are_measured_and_predicted(quick_run):
    _, doc, _ = quick_run
    _, blocks, _ = trace_model_file(frontend.load_model_file(MLP))
    block_rows = [r for r in doc["rows"] if r["level"] == "block"]
    assert [int(r["name"].split()[0]) for r in block_rows] == list(range(len(blocks)))
    assert [r["level"] for r in doc["rows"]].count("model") == 1
    for r in doc["rows"]:
        assert r["measured"]["fwd_s"] > 0, r
        for flavour in ("datasheet", "calibrated"):
            p = r["predicted"][flavour]
            assert math.isfinite(p["fwd_s"]) and math.isfinite(p["bwd_s"]), r
            # views are free by the datasheet (no launch); with a calibration they cost their measured dispatch
            free = flavour == "datasheet" and r["group"] == "view"
            assert (p["fwd_s"] == p["bwd_s"] == 0) if free else (p["fwd_s"] > 0 and p["bwd_s"] > 0), r
    # the whole model is predicted as the sum of its blocks
    whole = next(r for r in doc["rows"] if r["level"] == "model")["predicted"]["calibrated"]
    assert whole["fwd_s"] == pytest.approx(sum(r["predicted"]["calibrated"]["fwd_s"] for r in block_rows))
    assert whole["bwd_s"] == pytest.approx(sum(r["predicted"]["calibrated"]["bwd_s"] for r in block_rows))


@pytest.mark.slow
def test_calibrated_predictions_are_near_the_measurements(quick_run):
    _, doc, _ = quick_run
    held_out = [r for r in doc["rows"] if r["source"] == "held-out"]
    assert {r["group"] for r in held_out} == {"matmul", "conv", "attention", "elementwise", "view"}
    for r in held_out:
        predicted = r["predicted"]["calibrated"]["fwd_s"] + r["predicted"]["calibrated"]["bwd_s"]
        measured = r["measured"]["fwd_s"] + r["measured"]["bwd_s"]
        assert 1 / HELD_OUT_FACTOR < predicted / measured < HELD_OUT_FACTOR, r
        datasheet = r["predicted"]["datasheet"]["fwd_s"] + r["predicted"]["datasheet"]["bwd_s"]
        assert datasheet == 0 or abs(math.log(predicted / measured)) < abs(math.log(datasheet / measured)), r
    whole = next(r for r in doc["rows"] if r["level"] == "model")
    assert 1 / WHOLE_MODEL_FACTOR < 1 + whole["error"]["calibrated"]["total"] < WHOLE_MODEL_FACTOR, whole
    # the catalog's CPU entry is a placeholder (1 TFLOP/s): measuring this host must predict ops better
    summary = doc["summary"]
    assert summary["calibrated"]["op"]["total"] < summary["datasheet"]["op"]["total"]


@pytest.mark.slow
def test_results_carry_the_documented_fields(quick_run):
    out, doc, stdout = quick_run
    assert {"date", "device", "torch_version", "precision", "calibration", "host", "summary", "rows"} <= set(doc)
    assert doc["device"]["kind"] == "cpu" and doc["device"]["name"] and doc["device"]["catalog_type"] == "CPU"
    assert doc["precision"] == "fp32" and doc["threads"] == 1
    cal = doc["calibration"]
    assert cal["profiled_now"] and load_calibration(cal["path"]).device_name == "CPU"
    assert cal["path"] == str(out.with_name("single_device_cpu_calibration.json"))
    for flavour in ("datasheet", "calibrated"):
        assert {"op", "op held-out", "op graph", "block", "model", "op_class"} <= set(doc["summary"][flavour])
        assert set(doc["summary"][flavour]["op"]) == {"rows", "fwd", "bwd", "total", "total_weighted",
                                                      "pass_spread_median"}
    assert "mean |error|" in stdout and f"wrote {out}" in stdout


def test_a_missing_calibration_file_is_one_line_and_a_nonzero_exit(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    code = fidelity_main(["--single-device", "--device", "cpu", "--quick", "--calibration", str(missing),
                          "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and str(missing) in err and "file not found" in err
    assert not (tmp_path / "r.json").exists()


def test_a_calibration_of_another_device_type_is_refused(tmp_path, capsys):
    other = tmp_path / "h200.json"
    other.write_text(json.dumps(synthetic(name="H200")))
    code = single_device.main(["--device", "cpu", "--quick", "--calibration", str(other), "--out",
                               str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "H200" in err and "device.name" in err


def test_only_op_class_rates_of_a_calibration_are_used(tmp_path):
    """A calibration that timed the model, on a shared host, predicts blocks from its op-class rates alone."""
    doc = copy.deepcopy(synthetic())
    doc["host_sharing"]["contention_factor"] = 2.0
    doc["models"] = {"k": {"path": str(MLP), **dict.fromkeys(
        ("fwd_s_per_sample", "fwd_s_per_micro_batch", "bwd_s_per_sample", "bwd_s_per_micro_batch",
         "batch_s_per_sample", "batch_s_per_call"), 1.0)}}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    assert load_calibration(path).models and load_calibration(path).contention_factor == 2.0
    cal = single_device.op_rates_only(path)
    assert not cal.models and cal.contention_factor == 1.0
    assert cal.rates("fp32", "matmul").fwd_work_per_s == doc["compute"]["fp32"]["matmul"]["fwd_flop_per_s"]


def test_distinct_calls_cover_every_aten_call_of_the_graph():
    import torch

    model_file = frontend.load_model_file(MLP)
    gm, inputs = blockbench.trace_on_device(model_file, 4, torch.device("cpu"), torch.float32)
    calls = blockbench.distinct_calls(gm, inputs)
    aten_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert sum(c.nodes for c in calls) == len(aten_nodes)
    assert {c.count.op_class for c in calls} == {"matmul", "elementwise"}
    assert len({(c.label, str(c.target)) for c in calls}) == len(calls)


def test_the_one_gpu_plan_of_the_gpu_check_plans_without_a_gpu(tmp_path):
    """gpu_check.sh's program: examples/gpt on one H200 (benchmarks/clusters/gpu-1.yaml), one stage."""
    code = plan_main([str(EXAMPLES / "gpt" / "model.py"), "--cluster", str(REPO / "benchmarks" / "clusters" /
                      "gpu-1.yaml"), "--stages", "1", "--micro-batch", "32", "--global-batch", "256",
                      "--no-runners-up", "-o", str(tmp_path / "out")])
    assert code == 0
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["world_size"] == 1 and plan["estimates"]["iteration_s"] > 0


@pytest.mark.slow
def test_the_gpu_check_script_runs_its_steps_on_cpu_and_returns_two_files(tmp_path):
    """`gpu_check.sh --cpu-dry-run` with $OUT set, as a device call runs it: every step ok, and $OUT
    holds the summary and one archive (the device returns at most 8 files)."""
    import os
    import subprocess
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "gpu_check.txt"]
    summary = (out / "gpu_check.txt").read_text()
    for step in ("kernels", "profile", "single-device", "tp-matmul", "plan", "program"):
        assert any(line.split()[:2] == [step, "ok"] for line in summary.splitlines()), summary
    assert "program gpt 1 device: estimate" in summary
    with tarfile.open(out / "gpu_check.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"./single_device_cpu.json", "./kernels_cpu.json", "./tp_matmul_cpu.json",
            "./gpu_program_gpt/run/metrics.jsonl"} <= names
