"""`plan profile` and calibrated costing: a quick profile writes a valid file in seconds; a calibration
moves the cost tables the way its figures say; a bad file is one line naming the file and the field."""

from __future__ import annotations

import copy
import json
import time

import pytest

from costmodel import tensor_parallel
from costmodel.calibration import SCHEMA_VERSION, CalibrationError, load_calibration, model_key, parse_calibration
from costmodel.tables import build_tables
from planner import frontend
from planner.api import DEFAULT_TRACE_BATCH, trace_model_file
from planner.cli import main
from planner.frontend.cluster import load_cluster
from planner.profiling.calibrate import fit_line, fit_nonneg
from tests import synthetic_tp as syn_tp
from tests.helpers import CLUSTERS, EXAMPLES, run_plan_cli

# `--quick` stays quick (a full profile takes a minute and more). A loose bound (the suite runs beside it on two
# workers, and a quick profile alone takes ~15 s here), not a speed target
QUICK_PROFILE_LIMIT_S = 60.0
MLP = EXAMPLES / "mlp" / "model.py"
HETERO = CLUSTERS / "cpu-hetero-4.yaml"


def _rates(unit: str, rate: float, fwd_over_s: float, bwd_over_s: float) -> dict[str, float]:
    return {"fwd_overhead_s": fwd_over_s, "bwd_overhead_s": bwd_over_s, f"fwd_{unit}_per_s": rate,
            f"bwd_{unit}_per_s": rate / 2}


def synthetic(name: str = "CPU", matmul_flop_s: float = 1e10, overhead_s: float = 5e-5) -> dict:
    """A valid calibration document with round figures (slow compute, large per-op overhead)."""
    return {
        "schema_version": SCHEMA_VERSION, "measured_at": "2025-01-01T00:00:00Z",
        "device": {"name": name, "description": "test", "kind": "cpu", "concurrent_processes": 1,
                   "threads_per_process": 1},
        "compute": {"fp32": {
            "matmul": _rates("flop", matmul_flop_s, overhead_s, 2 * overhead_s),
            "conv": _rates("flop", matmul_flop_s, overhead_s, 2 * overhead_s),
            "attention": _rates("flop", matmul_flop_s, overhead_s, 2 * overhead_s),
            "elementwise": _rates("byte", 1e9, overhead_s, 2 * overhead_s),
            "view": {"fwd_overhead_s": overhead_s / 5, "bwd_overhead_s": overhead_s / 5}}},
        "optimizer": {"per_step_s": 2e-4, "per_tensor_s": 1e-4, "param_bytes_per_s": 1e9},
        "comm": {"p2p": {"latency_s": 2e-4, "bandwidth_bytes_per_s": 1e9},
                 "allreduce_2": {"latency_s": 3e-4, "bandwidth_bytes_per_s": 5e8},
                 "allreduce_ring": {"latency_s": 2e-4, "bandwidth_bytes_per_s": 5e8}},
        "memory": {"framework_bytes": 300 * 2**20},
        "host_sharing": {"processes": 1, "cores": 1, "contention_factor": 1.0},
    }


@pytest.fixture(scope="module")
def mlp_blocks():
    _, blocks, _ = trace_model_file(frontend.load_model_file(MLP))
    return blocks


def _tables(blocks, calibration=None, cluster=HETERO):
    return build_tables(blocks, load_cluster(cluster), global_batch=16, trace_batch=DEFAULT_TRACE_BATCH,
                        calibration=calibration)


@pytest.mark.slow
def test_quick_profile_writes_a_valid_file_in_seconds(tmp_path, mlp_blocks):
    out = tmp_path / "calibration.json"
    start = time.perf_counter()
    proc = run_plan_cli("profile", "--quick", "--out", str(out), timeout_s=120)
    elapsed_s = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed_s < QUICK_PROFILE_LIMIT_S, f"quick profile took {elapsed_s:.1f} s"
    cal = load_calibration(out)
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and cal.device_name == "CPU" and cal.kind == "cpu"
    assert {"matmul", "conv", "attention", "elementwise", "view"} <= set(cal.compute["fp32"])
    # one CPU core does between 100 MFLOP/s and 10 TFLOP/s; a process holds tens of MiB at least
    assert 1e8 < cal.peak_flops_s < 1e13
    assert cal.framework_bytes > 50 * 2**20 and cal.p2p.bandwidth_bytes_s > 0
    # one core measured is far below the catalog placeholder (1 TFLOP/s), and eager dispatch costs more
    # than the 4 us default per op: a micro-batch of the mlp costs more once calibrated
    assert cal.peak_flops_s < load_cluster(HETERO).nodes[0].device.peak("fp32")
    plain, measured = _tables(mlp_blocks), _tables(mlp_blocks, cal)
    assert sum(measured.classes[0].overhead_s) > sum(plain.classes[0].overhead_s)
    assert _micro_batch_s(measured.classes[0], 8) > _micro_batch_s(plain.classes[0], 8)


def _micro_batch_s(table, rows: int) -> float:
    """Forward + backward of every block for one micro-batch of `rows` samples."""
    return sum((f + b) * rows + o for f, b, o in zip(table.fwd_s, table.bwd_s, table.overhead_s))


def test_calibration_moves_the_tables_the_expected_way(mlp_blocks):
    plain = _tables(mlp_blocks)
    slow = _tables(mlp_blocks, parse_calibration(synthetic(matmul_flop_s=1e10)))
    slower = _tables(mlp_blocks, parse_calibration(synthetic(matmul_flop_s=1e9, overhead_s=1e-4)))
    for ci in range(2):   # both node groups derive from CPU (`base: CPU`)
        p, s, s2 = plain.classes[ci], slow.classes[ci], slower.classes[ci]
        assert sum(p.fwd_s) < sum(s.fwd_s) < sum(s2.fwd_s)
        assert sum(p.bwd_s) < sum(s.bwd_s) < sum(s2.bwd_s)
        assert sum(p.overhead_s) < sum(s.overhead_s) < sum(s2.overhead_s)
        assert sum(p.optimizer_s) < sum(s.optimizer_s)       # 100 us per tensor vs streaming bytes
        assert s.intra_latency_s == pytest.approx(2e-4)        # gloo p2p replaces the shm datasheet link
        assert s.model_bytes > p.model_bytes                   # 300 MiB framework instead of ~413 MiB
        assert s.capacity_bytes == p.capacity_bytes            # the device's memory x (1 - margin) either way
    # the slow group keeps its emulation factor on top of the measured figures
    assert slow.classes[1].fwd_s[1] == pytest.approx(3 * slow.classes[0].fwd_s[1])
    assert slow.inter_latency_s == pytest.approx(2e-4)        # loopback network = this host: ring fit


def test_tensor_parallel_all_reduces_cost_the_measured_all_reduce_not_a_message(mlp_blocks):
    """On calibrated CPU devices a TP pair's all-reduce is priced at the all-reduce microbenchmark's ring
    (per hop; not the gradient sync's in-situ factor), while messages between stages keep the
    point-to-point figures; uncalibrated, both are the node's intra link."""
    doc = synthetic()
    doc["comm"]["allreduce_ring"] = {"latency_s": 1e-3, "bandwidth_bytes_per_s": 2e8}
    # the gradient sync's in-situ factor (inside the models' steps) is the gradient sync's alone
    doc["in_situ"] = {"method": "test", "sync_factor": 3.0, "update_factor": 1.0}
    measured, plain = _tables(mlp_blocks, parse_calibration(doc)), _tables(mlp_blocks)
    assert measured.inter_latency_s == pytest.approx(3e-3)                  # loopback network: the sync's ring
    for ci in range(2):
        m, p = measured.classes[ci], plain.classes[ci]
        assert m.intra_latency_s == pytest.approx(2e-4)                    # p2p: stage to stage
        assert (m.collective_link.latency_s, m.collective_link.bandwidth_bytes_s) == pytest.approx((1e-3, 2e8))
        assert (p.collective_link.latency_s, p.collective_link.bandwidth_bytes_s) == \
            (p.intra_latency_s, p.intra_bandwidth_bytes_s)
    pairs, nbytes = 2, 1e6
    shards = [syn_tp.sharding(g, allreduces=pairs, allreduce_bytes=nbytes) for g in measured.grad_bytes]
    base = syn_tp.with_shardings(measured, shards)
    at_2 = tensor_parallel.at_degree(base, base.shardings, 2)
    for b in range(base.num_blocks):
        # per micro-batch: each pair's all-reduce forward and backward, 2(t-1) = 2 hops of 1 ms each
        added_s = at_2.classes[0].overhead_s[b] - base.classes[0].overhead_s[b]
        assert added_s == pytest.approx(2 * pairs * 2 * 1e-3)
        # per sample: 2(t-1)/t of the bytes at the ring's bandwidth, on top of the halved compute
        kept = 1 - 0.9 * (1 - 1 / 2)
        assert at_2.classes[0].fwd_s[b] == pytest.approx(base.classes[0].fwd_s[b] * kept + nbytes / 2e8)


def test_calibration_of_another_device_changes_nothing(mlp_blocks):
    plain = _tables(mlp_blocks)
    other = _tables(mlp_blocks, parse_calibration(synthetic(name="H200")))
    assert other == plain


def test_measured_model_timing_sets_the_totals(mlp_blocks):
    doc = synthetic()
    key = model_key(tuple(b.signature for b in mlp_blocks), tuple(b.fwd_flops for b in mlp_blocks))
    doc["models"] = {key: {"path": str(MLP), "fwd_s_per_sample": 1e-4, "fwd_s_per_micro_batch": 2e-3,
                           "bwd_s_per_sample": 3e-4, "bwd_s_per_micro_batch": 4e-3,
                           "batch_s_per_sample": 1e-5, "batch_s_per_call": 1e-4}}
    plain = _tables(mlp_blocks, parse_calibration(synthetic())).classes[0]   # the same without the model
    fast, slow = _tables(mlp_blocks, parse_calibration(doc)).classes
    assert sum(fast.fwd_s) == pytest.approx(1e-4)
    assert sum(fast.bwd_s) == pytest.approx(3e-4)
    assert sum(fast.overhead_s) == pytest.approx(6e-3)
    assert sum(slow.overhead_s) == pytest.approx(3 * 6e-3)             # emulated 3x slower device
    # every rank builds the global batch (16 rows) once per step: charged with the first block's optimizer
    assert fast.optimizer_s[0] - plain.optimizer_s[0] == pytest.approx(1e-4 + 16 * 1e-5)
    assert fast.optimizer_s[1:] == plain.optimizer_s[1:]


def test_contention_turns_cpu_seconds_into_wall_seconds(mlp_blocks):
    """Compute, update and batch were timed in CPU seconds; a process getting half a core takes twice the
    wall time for them, while links (timed in wall seconds) stay as measured."""
    doc = synthetic()
    key = model_key(tuple(b.signature for b in mlp_blocks), tuple(b.fwd_flops for b in mlp_blocks))
    doc["models"] = {key: {"path": str(MLP), "fwd_s_per_sample": 1e-4, "fwd_s_per_micro_batch": 2e-3,
                           "bwd_s_per_sample": 3e-4, "bwd_s_per_micro_batch": 4e-3,
                           "batch_s_per_sample": 1e-5, "batch_s_per_call": 1e-4}}
    shared = copy.deepcopy(doc)
    shared["host_sharing"]["contention_factor"] = 2.0
    alone, half = (_tables(mlp_blocks, parse_calibration(d)) for d in (doc, shared))
    for a, h in zip(alone.classes, half.classes, strict=True):
        for field in ("fwd_s", "bwd_s", "overhead_s", "optimizer_s"):
            assert getattr(h, field) == pytest.approx(tuple(2 * v for v in getattr(a, field)))
        assert h.intra_latency_s == a.intra_latency_s and h.intra_bandwidth_bytes_s == a.intra_bandwidth_bytes_s
    assert half.inter_bandwidth_bytes_s == alone.inter_bandwidth_bytes_s
    # a model the profile did not time is costed from the op-class rates: twice as slow as well
    del doc["models"], shared["models"]
    alone, half = (_tables(mlp_blocks, parse_calibration(d)).classes[0] for d in (doc, shared))
    assert sum(half.fwd_s) == pytest.approx(2 * sum(alone.fwd_s))


def test_one_process_alone_gets_a_whole_core_or_less():
    """Wall per CPU second of a single-threaded process (as the profiling workers are): 1 with a core to
    itself, more only when other processes share it."""
    import torch

    from planner.profiling.microbench import measure_contention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert measure_contention(0.05) >= 0.95
    finally:
        torch.set_num_threads(threads)


def test_fits_recover_known_lines():
    xs = [1e3, 1e5, 1e7]
    a, b = fit_line(xs, [5e-6 + x / 1e10 for x in xs])
    assert a == pytest.approx(5e-6, rel=1e-6) and 1 / b == pytest.approx(1e10, rel=1e-6)
    assert fit_nonneg([[1.0, 1.0, 1.0], xs], [3.0 - x * 1e-8 for x in xs])[1] == 0.0   # never negative
    tensors, nbytes = [2.0, 16.0, 4.0, 32.0], [2e3, 2e4, 1e6, 3e4]
    coef = fit_nonneg([[1.0] * 4, tensors, nbytes], [1e-3 + t * 5e-5 + b * 1e-9 for t, b in zip(tensors, nbytes)])
    assert coef == pytest.approx([1e-3, 5e-5, 1e-9], rel=1e-6)


BAD_CASES = [
    (lambda d: d.pop("compute"), "compute", "missing required field"),
    (lambda d: d.update(schema_version=99), "schema_version", "this hetplan reads"),
    (lambda d: d["compute"]["fp32"]["matmul"].update(fwd_flop_per_s=-1.0), "compute.fp32.matmul.fwd_flop_per_s",
     "must be > 0"),
    (lambda d: d["comm"]["p2p"].update(latency_s="fast"), "comm.p2p.latency_s", "expected a finite number"),
    (lambda d: d["compute"]["fp32"].update(gemm={}), "compute.fp32.gemm", "unknown op class"),
    (lambda d: d["device"].pop("name"), "device.name", "missing required field"),
]


@pytest.mark.parametrize("corrupt, field, words", BAD_CASES, ids=[c[1] for c in BAD_CASES])
def test_bad_calibration_is_one_line_naming_file_and_field(tmp_path, capsys, corrupt, field, words):
    doc = copy.deepcopy(synthetic())
    corrupt(doc)
    bad = tmp_path / "bad-calibration.json"
    bad.write_text(json.dumps(doc))
    code = main([str(MLP), "--cluster", str(HETERO), "--calibration", str(bad), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("plan: error: ") and "bad-calibration.json" in err and field in err and words in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, words", [(None, "file not found"), ("{not json", "not valid JSON"),
                                         ("[]", "expected an object")])
def test_unreadable_calibration(tmp_path, text, words):
    path = tmp_path / "c.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CalibrationError) as info:
        load_calibration(path)
    line = info.value.one_line()
    assert "c.json" in line and words in line and "\n" not in line
