"""`plan profile`: measure this machine's device and write a calibration file.

Runs `max(concurrency, 2)` worker processes (`planner.profiling.calibrate_worker`) on gloo (a free local
port, a short collective timeout); the first `concurrency` of them run every compute benchmark at the
same time, so the figures describe one rank of a job with that many processes sharing the host (the
emitted program on CPU runs one single-threaded process per device); on a CPU they are timed in CPU
seconds and windows of CPU-bound work on all of them at once give the share of a core each gets
(`host_sharing.contention_factor`). Pairs of workers, then all of them, measure point-to-point (also
while the others compute, as in a pipeline) and all-reduce; with `--model`, the computing workers train
the model together for a few steps (`planner.profiling.modelbench`). This parent fits the medians over workers
and writes the JSON that `costmodel.calibration.load_calibration` reads, with the load other processes
put on the host meanwhile (`host_load`). Children are reaped on success, failure or timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from costmodel.calibration import DENSE_CLASSES, SCHEMA_VERSION, CalibrationError, parse_calibration, to_json

# Whole-run limits (start-up of the workers included: importing torch takes a few seconds each).
QUICK_TIMEOUT_S = 60.0
FULL_TIMEOUT_S = 600.0
QUICK_REPEATS = 5
FULL_REPEATS = 15
# Small micro-batch sizes at which a given model is timed (with one large size modelbench picks per model:
# slope = per sample, intercept = per micro-batch).
MODEL_MICRO_BATCHES = (1, 8)
# Share of a core per process: windows of CPU-bound work on every computing worker at once, each much
# longer than a scheduler time slice (a few ms), median over windows and workers.
CONTENTION_WINDOW_S = 0.25
CONTENTION_WINDOWS = 4
QUICK_CONTENTION_WINDOWS = 1
# Floor of the in-situ factors: a figure measured as (almost) free in place is noise, not a faster link.
MIN_IN_SITU_FACTOR = 0.25
METHOD = ("chains of 8 aten ops per class and size (own weights each), forward with autograd recording and "
          "backward, each repetition after 2 ms of unrelated work, in CPU seconds on a CPU device; medians "
          "over repeats, then over the concurrent workers; fits time = overhead + work/rate weighted by "
          "1/time, work as counted by costmodel.ops.OpCounter; CPU seconds become wall seconds at the "
          "measured share of a core (host.contention_factor)")


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq, steal: /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its finished (reaped) descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """Cores kept busy, on average while the `with` block runs, by processes other than this one and the
    children it reaped in the block: load that measurements taken meanwhile did not ask for. `cores` is
    None where /proc/stat is missing (not Linux)."""

    cores: float | None = None

    def __enter__(self) -> OtherLoad:
        try:
            self._start: tuple[float, float, float] | None = (time.perf_counter(), _busy_cpu_s(), _own_cpu_s())
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None:
            wall, busy, own = (b - a for a, b in zip(self._start, (time.perf_counter(), _busy_cpu_s(), _own_cpu_s()),
                                                     strict=True))
            self.cores = max(busy - own, 0.0) / max(wall, 1e-9)


# A fixed piece of single-threaded CPU work (matmuls of 128 x 128 and a sweep over 4 MB), timed in CPU
# seconds: how fast a core of this host is right now. On a virtual host it is not constant - measured
# here, 3.6-3.9 ms in some minutes and 5.0-5.4 ms in others - so figures measured in one phase and runs
# in the other differ by that much whatever the cost model says; the profile records it to tell them apart.
REFERENCE_MATMULS = 100
REFERENCE_SWEEPS = 5
REFERENCE_REPEATS = 15


def reference_work_s() -> float:
    """Median CPU seconds of the reference work (see above) in this process, one torch thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, buf = torch.randn(128, 128), torch.randn(1 << 20)
        times = []
        for i in range(REFERENCE_REPEATS + 1):      # the first one warms up
            start = time.process_time()
            for _ in range(REFERENCE_MATMULS):
                a @ a
            for _ in range(REFERENCE_SWEEPS):
                buf.mul_(1.0)
            if i:
                times.append(time.process_time() - start)
        return median(times)
    finally:
        torch.set_num_threads(threads)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; every core where the OS does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile(*, quick: bool = False, concurrency: int = 1, device: str = "cpu", device_name: str | None = None,
            models: tuple[str, ...] = (), timeout_s: float | None = None) -> dict[str, Any]:
    """Measure and fit; returns the calibration document (validated by `parse_calibration`)."""
    world = max(concurrency, 2)
    limit_s = timeout_s or (QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    reference_before_s = reference_work_s()
    with tempfile.TemporaryDirectory(prefix="hetplan-profile-") as tmp, OtherLoad() as other:
        port = free_port()
        procs: list[tuple[subprocess.Popen[bytes], Any]] = []
        try:
            _spawn(procs, world, port, tmp, quick, concurrency, device, models)
        except BaseException:
            _reap(procs)
            raise
        _wait_all(procs, limit_s, tmp)
        results = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    doc = _document(results, concurrency, device, device_name)
    # other processes' load slows what was measured: kept with the figures, so a noisy file shows it
    doc["host_load"] = {"load_average_1min_before": load_before, "other_cores_during": other.cores,
                        "reference_work_s": [reference_before_s, reference_work_s()]}
    parse_calibration(doc, "<measured>")   # what we write must read back
    return doc


PACKAGES_ROOT = Path(__file__).resolve().parents[2]     # planner/profiling/calibrate.py -> the checkout


def _spawn(procs: list[tuple[subprocess.Popen[bytes], Any]], world: int, port: int, tmp: str, quick: bool,
           concurrency: int, device: str, models: tuple[str, ...]) -> None:
    """Start the workers, appending each (process, log file) to `procs` as soon as it runs."""
    for rank in range(world):
        cmd = [sys.executable, "-m", "planner.profiling.calibrate_worker", "--rank", str(rank), "--world", str(world),
               "--port", str(port), "--dir", tmp, "--concurrency", str(concurrency), "--device", device]
        cmd += ["--quick"] if quick else []
        for m in models:
            cmd += ["--model", str(Path(m).resolve())]
        log = open(Path(tmp) / f"worker{rank}.log", "w")  # noqa: SIM115 (closed by _wait_all)
        try:
            # from the folder that holds the packages: `-m` puts the working directory first on sys.path
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=PACKAGES_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        except BaseException:
            log.close()
            raise
        procs.append((proc, log))


def _wait_all(procs: list[tuple[subprocess.Popen[bytes], Any]], limit_s: float, tmp: str) -> None:
    deadline = time.monotonic() + limit_s
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        raise CalibrationError(f"profiling workers did not finish within {limit_s:.0f} s", field="workers",
                               fix="retry on a quieter machine, or pass a longer --timeout") from None
    finally:
        _reap(procs)
    failed = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        rank, code = failed[0]
        tail = (Path(tmp) / f"worker{rank}.log").read_text().strip().splitlines()[-1:] or ["no output"]
        raise CalibrationError(f"profiling worker {rank} exited with {code}: {tail[0][:200]}", field="workers",
                               fix="see the message; `plan profile --quick` checks the set-up quickly")


def _reap(procs: list[tuple[subprocess.Popen[bytes], Any]]) -> None:
    """Kill the workers still running (each leads its own session: it and its children), wait for all."""
    for proc, log in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


# ---- fitting ----------------------------------------------------------------------------------------
def fit_nonneg(columns: list[list[float]], ys: list[float]) -> list[float]:
    """Non-negative coefficients c of y = sum_i c_i * columns[i], least squares on relative error
    (weights 1/y, so microsecond and millisecond points count alike). A coefficient the unconstrained
    fit makes negative is fixed at zero and the rest refitted (an active-set pass; enough for the
    two or three columns used here)."""
    import numpy as np

    y = np.asarray(ys, dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    a = np.stack([np.asarray(c, dtype=float) * w for c in columns], axis=1)
    active = list(range(len(columns)))
    coef = np.zeros(len(columns))
    while active:
        sub = np.linalg.lstsq(a[:, active], y * w, rcond=None)[0]
        if (sub >= 0).all():
            coef[active] = sub
            break
        active.pop(int(np.argmin(sub)))
    return [float(c) for c in coef]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept >= 0, slope > 0) of y = a + b x (see `fit_nonneg`); a zero slope falls back to the
    best observed marginal rate, so a rate is always finite."""
    a, b = fit_nonneg([[1.0] * len(xs), list(xs)], list(ys))
    if b <= 0:
        b = min(max(y - a, 1e-12) / max(x, 1e-30) for x, y in zip(xs, ys, strict=True))
    return a, b


def _ring_fit(points: list[dict[str, float]]) -> dict[str, float]:
    """Latency and bandwidth of the ring model 2(n-1) * latency + 2(n-1)/n * bytes / bandwidth, fitted
    to all-reduces measured over n processes."""
    hops = [2 * (p["processes"] - 1) for p in points]
    volume = [2 * (p["processes"] - 1) / p["processes"] * p["bytes"] for p in points]
    latency, per_byte = fit_nonneg([hops, volume], [p["time_s"] for p in points])
    if per_byte <= 0:
        per_byte = min(p["time_s"] / v for p, v in zip(points, volume, strict=True))
    return {"latency_s": latency, "bandwidth_bytes_per_s": 1.0 / per_byte}


def _op_class_fit(points: list[dict[str, Any]], op_class: str) -> dict[str, float]:
    if op_class == "view":
        return {"fwd_overhead_s": median(p["fwd_s"] for p in points),
                "bwd_overhead_s": median(p["bwd_s"] for p in points)}
    unit, fwd_key, bwd_key = ("flop", "fwd_flops", "bwd_flops") if op_class in DENSE_CLASSES else \
        ("byte", "fwd_bytes", "bwd_bytes")
    fa, fb = fit_line([p[fwd_key] for p in points], [p["fwd_s"] for p in points])
    ba, bb = fit_line([p[bwd_key] for p in points], [p["bwd_s"] for p in points])
    return {"fwd_overhead_s": fa, "bwd_overhead_s": ba, f"fwd_{unit}_per_s": 1.0 / fb,
            f"bwd_{unit}_per_s": 1.0 / bb}


def _alpha_beta(points: list[dict[str, float]]) -> dict[str, float]:
    a, b = fit_line([p["bytes"] for p in points], [p["time_s"] for p in points])
    return {"latency_s": a, "bandwidth_bytes_per_s": 1.0 / b}


def _medians(per_rank: list[list[dict[str, Any]]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Point-wise medians over ranks of the measured `keys` (other fields from the first rank)."""
    out = []
    for i, first in enumerate(per_rank[0]):
        merged = dict(first)
        for key in keys:
            merged[key] = median(r[i][key] for r in per_rank)
        out.append(merged)
    return out


def _optimizer_fit(points: list[dict[str, float]]) -> dict[str, float | str]:
    """time = per_step_s + tensors * per_tensor_s + param_bytes / rate, all terms non-negative."""
    per_step, per_tensor, per_byte = fit_nonneg(
        [[1.0] * len(points), [p["tensors"] for p in points], [p["param_bytes"] for p in points]],
        [p["time_s"] for p in points])
    if per_byte <= 0:
        per_byte = min(p["time_s"] / p["param_bytes"] for p in points)
    return {"per_step_s": per_step, "per_tensor_s": per_tensor, "param_bytes_per_s": 1.0 / per_byte,
            "what": "per step: the program's gradient-sync bookkeeping (no transfer), AdamW step, zero_grad"}


def _document(results: list[dict[str, Any]], concurrency: int, device: str,
              device_name: str | None) -> dict[str, Any]:
    computing = results[:concurrency]
    compute: dict[str, dict[str, Any]] = {}
    samples: dict[str, Any] = {"compute": {}}
    for precision in computing[0]["compute"]:
        points = _medians([r["compute"][precision] for r in computing], ("fwd_s", "bwd_s"))
        samples["compute"][precision] = points
        classes = sorted({p["op_class"] for p in points})
        compute[precision] = {c: _op_class_fit([p for p in points if p["op_class"] == c], c) for c in classes}
    optimizer = _medians([r["optimizer"] for r in computing], ("time_s",))
    pairs = [r for r in results if r["comm"]["p2p"]]
    comm = {kind: _medians([r["comm"][kind] for r in pairs], ("time_s",))
            for kind in ("p2p", "allreduce_2", "p2p_in_place")}
    # the ring link comes from the all-reduce over all workers when there are more than two (the job's
    # data-parallel group on this host; gloo's per-hop cost grows with oversubscription), else the pair's
    ring_points = [{**p, "processes": 2.0} for p in comm["allreduce_2"]]
    if "allreduce_world" in results[0]["comm"]:
        comm["allreduce_world"] = _medians([r["comm"]["allreduce_world"] for r in results], ("time_s",))
        ring_points = comm["allreduce_world"]
    samples.update(optimizer=optimizer, comm=comm)
    first = results[0]
    windows = [w for r in computing for w in r.get("contention") or []]
    contention = max(median(windows), 1.0) if windows else 1.0
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "device": {"name": device_name or first["device_name"], "description": first["description"],
                   "kind": device, "concurrent_processes": concurrency,
                   "threads_per_process": first["threads_per_process"]},
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node() or "unknown", "cpu_cores": os.cpu_count() or 1,
        "host_sharing": {"processes": concurrency, "cores": os.cpu_count() or 1, "usable_cores": usable_cores(),
                         "contention_factor": contention, "windows": windows, "method": (
                             f"wall / CPU seconds of {CONTENTION_WINDOW_S} s windows of CPU-bound work run by "
                             "every computing worker at once; converts the CPU seconds of compute, update and "
                             "batch figures to wall seconds of one process of such a job, and, with the usable "
                             "cores, of jobs of other sizes (costmodel.host_sharing)")},
        "torch_version": first["torch_version"], "method": METHOD,
        "compute": compute, "optimizer": _optimizer_fit(optimizer),
        "comm": {"backend": "gloo", "processes": len(results), "p2p": _alpha_beta(comm["p2p"]),
                 "p2p_in_place": _alpha_beta(comm["p2p_in_place"]),
                 "allreduce_2": _alpha_beta(comm["allreduce_2"]), "allreduce_ring": _ring_fit(ring_points)},
        "memory": {"torch_process_group_bytes": median(r["torch_process_group_bytes"] for r in results),
                   "framework_bytes": median(r["framework_bytes"] for r in results),
                   "method": "VmHWM of a worker after import torch + gloo init_process_group, then after "
                             "importing the emitted program's runtime and tracing a small model"},
        "samples": samples,
    }
    if computing[0]["models"]:
        doc["models"] = _model_timings(computing, doc)
        timed = [m for m in doc["models"].values() if m["processes"] >= 2]
        if timed:
            doc["in_situ"] = {
                "sync_factor": max(median(m["sync_in_situ_factor"] for m in timed), MIN_IN_SITU_FACTOR),
                "update_factor": max(median(m["update_in_situ_factor"] for m in timed), MIN_IN_SITU_FACTOR),
                "method": (
                    "medians over the timed models of: the gradient sync measured inside their training "
                    "step / the ring all-reduce predicted from the microbenchmark fit, which it scales; and "
                    "the update measured inside the step (CPU s) / the update fit, which it scales")}
    return doc


def _model_timings(computing: list[dict[str, Any]], doc: dict[str, Any]) -> dict[str, Any]:
    """Per timed model: forward/backward/batch() fits over the micro-batch sizes (CPU seconds on a CPU
    device), and how its gradient sync and update in place compare with the microbenchmark fits.

    The sync in place is the wall time of the program's gradient sync inside the step: the all-reduce
    entered right after compute, while every other process of the job is in it too (on a virtual host
    idle processors wake up slowly: measured here, an all-reduce of 4 bytes over 4 processes took
    7-24 ms after compute against ~1 ms between busy processes), and the wait for ranks whose compute
    ended later."""
    timings = {}
    ring, update = doc["comm"]["allreduce_ring"], doc["optimizer"]
    for i, measured in enumerate(computing[0]["models"]):
        points = _medians([r["models"][i]["points"] for r in computing],
                          ("batch_s", "fwd_s", "bwd_s", "sync_s", "update_s", "step_s"))
        sizes = [p["micro_batch"] for p in points]
        fwd, bwd, data = (fit_line(sizes, [p[k] for p in points]) for k in ("fwd_s", "bwd_s", "batch_s"))
        n, nbytes, tensors = measured["processes"], measured["grad_bytes"], measured["param_tensors"]
        ring_s = 2 * (n - 1) * ring["latency_s"] + 2 * (n - 1) / n * nbytes / ring["bandwidth_bytes_per_s"]
        update_s = update["per_step_s"] + tensors * update["per_tensor_s"] + nbytes / update["param_bytes_per_s"]
        sync_s = median(p["sync_s"] for p in points)
        timings[measured["key"]] = {
            "path": measured["path"], "micro_batches": sizes, "processes": n, "grad_bytes": nbytes,
            "param_tensors": tensors, "fwd_s_per_sample": fwd[1], "fwd_s_per_micro_batch": fwd[0],
            "bwd_s_per_sample": bwd[1], "bwd_s_per_micro_batch": bwd[0], "batch_s_per_sample": data[1],
            "batch_s_per_call": data[0], "step_s": [p["step_s"] for p in points], "sync_s": sync_s,
            "update_s": median(p["update_s"] for p in points), "sync_in_situ_factor": sync_s / ring_s,
            "update_in_situ_factor": median(p["update_s"] for p in points) / update_s}
    return timings


def write_calibration(doc: dict[str, Any], out: Path) -> None:
    """Write atomically (a temporary sibling, then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(to_json(doc))
    os.replace(tmp, out)
