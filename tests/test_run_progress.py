"""`plan run` says what happens: a plain line per step while the program trains, and at the end each rank's
peak memory and the step time beside the plan's estimates and where the metrics and the logs are; a failed
run names the rank that failed first, with its own error.

- a 2-rank plan of a model whose data takes longer than PRINT_EVERY_S per step prints every step while the
  run is still going, each line's figures those of metrics.jsonl (loss, the slowest rank's step time,
  global batch over it);
- StepReport on a metrics file ranks append to: a step shows once every rank logged it, fast steps are
  thinned to one line per interval and the last step always shows, a torn line waits for its end;
- the end's step time line: the median of the slowest rank's step time after the warm-up steps beside the
  plan's estimate, by how much the estimate misses, and a note when it rests on placeholder figures;
- first_failure: when torchrun's "first observed failure" is a peer that failed in the same second because
  of it, the rank whose own log ended first is named, and torchrun's SIGTERM of the others never is.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.torchdist.local_run import PRINT_EVERY_S, STEP_TIME_WARMUP, StepReport, step_time_line
from backends.torchdist.program import metrics
from backends.torchdist.program.process_group import FOR_PEER_EXIT_CODE
from backends.torchdist.run_failures import failure_line, first_failure
from planner.core.ir import Plan
from tests.helpers import REPO, read_metrics, run_plan_cli

MIB = 1 << 20
STEPS = 3
RUN_TIMEOUT_S = 300           # start-up, tracing and three slow steps, on two busy cores
SLOW_DATA_MODEL = f'''\
import time

import torch
import torch.nn.functional as F
from torch import nn

DATA_S = {PRINT_EVERY_S + 0.5}    # each step's data takes this long: steps slower than the print interval


def model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def batch(batch_size, step):
    time.sleep(DATA_S)
    x = torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(step))
    return (x,), x[:, :4].argmax(dim=-1)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
'''
TWO_CPUS_SPEC = """\
name: two-cpus
nodes:
  - {name: cpus, count: 1, device: CPU, per_node: 2, intra_link: shm}
network:
  inter_node: {kind: loopback, bandwidth_gbit_s: 10, latency_us: 20}
"""
STEP_LINE = re.compile(r"^step (\d+) \((\d+)/(\d+)\): loss (-?[\d.]+|nan), ([\d.]+) s/step, ([\d,.]+) samples/s$")


@pytest.fixture(scope="module")
def two_rank_plan(tmp_path_factory) -> tuple[Path, Plan]:
    folder = tmp_path_factory.mktemp("progress")
    (folder / "model.py").write_text(SLOW_DATA_MODEL)
    (folder / "spec.yaml").write_text(TWO_CPUS_SPEC)
    out = folder / "out"
    proc = run_plan_cli(str(folder / "model.py"), "--cluster", str(folder / "spec.yaml"), "--global-batch", "8",
                        "--use-all-devices", "--no-runners-up", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    p = Plan.load(out)
    assert p.world_size == 2
    return out, p


@pytest.mark.slow
def test_plan_run_prints_each_slow_step_while_it_trains_then_memory_metrics_and_logs(two_rank_plan):
    out, p = two_rank_plan
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(out), "--steps", str(STEPS),
                             "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    lines: list[str] = []
    still_running_at_first_step = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        assert proc.stdout is not None
        for line in proc.stdout:                  # as the lines come, not after the end
            lines.append(line.rstrip("\n"))
            if still_running_at_first_step is None and line.startswith("step 0 "):
                still_running_at_first_step = proc.poll() is None
            assert time.monotonic() < deadline
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert still_running_at_first_step is True
    assert "\r" not in "".join(lines) and "\x1b" not in "".join(lines)         # plain lines, fine in a pipe
    # rank 0's plan table comes through torchrun, each line led by the plan rank (not "[default0]:")
    assert any(ln.startswith("[rank 0] hetplan plan: 2 ranks") for ln in lines), lines
    assert not any(ln.startswith("[default") for ln in lines), lines

    records = read_metrics(out / "run" / "metrics.jsonl")
    steps = [STEP_LINE.match(ln) for ln in lines if ln.startswith("step ")]
    assert all(steps), lines
    assert [(int(m[1]), int(m[2]), int(m[3])) for m in steps if m] == [(k, k + 1, STEPS) for k in range(STEPS)]
    for m in steps:
        assert m is not None
        of_step = [r for r in records if r["step"] == int(m[1])]
        assert len(of_step) == p.world_size
        slowest_s = max(r["step_time_s"] for r in of_step)
        assert float(m[4]) == pytest.approx(of_step[0]["loss"], abs=1e-4)
        assert float(m[5]) == pytest.approx(slowest_s, abs=1e-3) and slowest_s > PRINT_EVERY_S
        assert float(m[6].replace(",", "")) == pytest.approx(p.global_batch / slowest_s, abs=0.1)

    memory_line = next(ln for ln in lines if ln.startswith("plan run: peak memory"))
    for rank in range(p.world_size):
        peak = max(r["peak_memory_bytes"] for r in records if r["rank"] == rank)
        assert f"rank {rank} {peak / MIB:,.0f}/{p.estimates.memory_bytes[rank] / MIB:,.0f} MiB" in memory_line
    slowest_by_step = {k: max(r["step_time_s"] for r in records if r["step"] == k) for k in range(STEPS)}
    assert lines[-2] == step_time_line(p, slowest_by_step)
    assert f"{slowest_by_step[STEPS - 1]:.3f}/{p.estimates.iteration_s:.3f} s" in lines[-2]
    assert lines[-1] == (f"plan run: {STEPS} step(s); metrics: {out / 'run' / 'metrics.jsonl'}; "
                         f"logs: {out / 'run' / 'logs'}")


def _append(path: Path, rank: int, step: int, loss: float, step_time_s: float, peak_bytes: int,
            more: str = "") -> None:
    """One rank's metrics line, appended as the program appends it (`more`: further fields, `, "k": v`)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        line = (f'{{"rank": {rank}, "step": {step}, "loss": {loss}, "step_time_s": {step_time_s}, '
                f'"peak_memory_bytes": {peak_bytes}, "peak_reserved_bytes": null{more}}}\n')
        metrics.append_line(fd, line.encode(), str(path))
    finally:
        os.close(fd)


def _report(p: Plan, run: Path, every_s: float, steps: int) -> tuple[StepReport, list[str]]:
    printed: list[str] = []

    class Lines:
        def write(self, text: str) -> None:
            printed.extend(ln for ln in text.splitlines() if ln)

        def flush(self) -> None:
            pass
    return StepReport(p, run, Lines(), steps, every_s=every_s), printed   # type: ignore[arg-type]


def test_a_step_shows_once_every_rank_logged_it_and_fast_steps_are_thinned(two_rank_plan, tmp_path):
    _, p = two_rank_plan
    path = tmp_path / metrics.METRICS_FILE
    report, printed = _report(p, tmp_path, every_s=3600.0, steps=4)
    report.poll()
    assert printed == []                                          # no file yet
    _append(path, 0, 0, 2.5, 0.25, 300 * MIB)
    report.poll()
    assert printed == []                                          # rank 1 has not logged step 0
    _append(path, 1, 0, 2.5, 0.5, 310 * MIB)
    report.poll()
    assert printed == ["step 0 (1/4): loss 2.5000, 0.500 s/step, 16.0 samples/s"]
    for step in (1, 2):
        for rank in (0, 1):
            _append(path, rank, step, 2.0 - step / 10, 0.25, 320 * MIB)
        report.poll()
    assert len(printed) == 1                                      # thinned: within the interval
    with open(path, "ab") as f:
        f.write(b'{"rank": 0, "step": 3, "loss": 1.5, "step_')    # a line still being written
    report.poll()
    assert len(printed) == 1
    with open(path, "ab") as f:
        f.write(b'time_s": 0.1, "peak_memory_bytes": 400000000, "peak_reserved_bytes": null}\n')
    _append(path, 1, 3, 1.5, 0.2, 330 * MIB)
    report.poll()                                                 # the run's last step shows at once
    assert printed[1:] == ["step 3 (4/4): loss 1.5000, 0.200 s/step, 40.0 samples/s"]
    report.finish(tmp_path / "logs")
    estimate = [p.estimates.memory_bytes[r] / MIB for r in (0, 1)]
    assert printed[2:] == [
        f"plan run: peak memory (measured / the plan's estimate): rank 0 {400000000 / MIB:,.0f}/{estimate[0]:,.0f} "
        f"MiB, rank 1 330/{estimate[1]:,.0f} MiB",
        step_time_line(p, {0: 0.5, 1: 0.25, 2: 0.25, 3: 0.2}),
        f"plan run: 4 step(s); metrics: {path}; logs: {tmp_path / 'logs'}"]


def test_the_step_time_line_is_the_median_after_warm_up_beside_the_estimate(two_rank_plan):
    _, p = two_rank_plan
    calibrated = dataclasses.replace(p, warnings=(), estimates=dataclasses.replace(p.estimates, iteration_s=0.3))
    # a resumed run's steps 10-17: the first STEP_TIME_WARMUP left out, the median of the rest (0.2, 0.25, 0.4, 0.2,
    # 0.25 -> 0.25); the estimate 0.3 s is 20% over it
    times = dict(zip(range(10, 18), (9.0, 0.9, 0.5, 0.2, 0.25, 0.4, 0.2, 0.25)))
    assert STEP_TIME_WARMUP == 3
    assert step_time_line(calibrated, times) == ("plan run: step time (measured / the plan's estimate): 0.250/0.300 s "
                                                 "(the slowest rank's, median of steps 13-17), the estimate 20% over")
    slower = dataclasses.replace(calibrated, estimates=dataclasses.replace(p.estimates, iteration_s=0.2))
    assert step_time_line(slower, times).endswith("the estimate 20% under")
    # a short run keeps its last step; one step (the trace's) says nothing
    assert "median of step 1)" in step_time_line(calibrated, {0: 5.0, 1: 0.3})
    assert step_time_line(calibrated, {0: 5.0}) is None
    # shares changed by --rebalance: the estimate was for the planned ones
    assert step_time_line(calibrated, times, [12]).endswith(
        "the estimate 20% over; the shares changed after step 12 (--rebalance): the estimate is for the planned ones")
    # CPU processes standing in for GPUs: the estimate is for those, no miss claimed
    emulated = step_time_line(calibrated, times, (), ["A100-40GB", "V100\x1b[2J"])
    assert emulated == ("plan run: step time (measured / the plan's estimate): 0.250/0.300 s (the slowest rank's, "
                        "median of steps 13-17); CPU processes stood in for the plan's A100-40GB, V100\\x1b[2J (no GPU "
                        "here): the estimate is for those devices")
    # a plan on the catalog's placeholder CPU figures says so
    assert p.warnings and "placeholder" in p.warnings[0]
    assert step_time_line(p, times).endswith("it rests on placeholder figures: `plan profile`, then plan with "
                                             "--calibration FILE")


def test_with_no_interval_every_step_shows(two_rank_plan, tmp_path):
    _, p = two_rank_plan
    path = tmp_path / metrics.METRICS_FILE
    report, printed = _report(p, tmp_path, every_s=0.0, steps=3)
    _log_steps(report, path, range(3))
    assert [ln.split(":")[0] for ln in printed] == ["step 0 (1/3)", "step 1 (2/3)", "step 2 (3/3)"]


def _log_steps(report: StepReport, path: Path, steps: range, step_time_s: float = 0.1) -> None:
    """Both ranks log each of `steps` in `step_time_s` (the report polled after each)."""
    for step in steps:
        for rank in (0, 1):
            _append(path, rank, step, 1.0, step_time_s, MIB)
        report.poll()


# A torchrun failure report in which the peer (rank 0) found the connection closed within the same second
# as rank 1's own failure, and torchrun named the peer as the first observed failure.
REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/out/program/train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-01-01_10:00:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 102)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
[2]:
  time      : 2026-01-01_10:00:00
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -15 (pid: 103)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 103
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_10:00:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 101)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _rank_logs(log_dir: Path, said: dict[int, tuple[str, float]]) -> None:
    """Each rank's stderr.log where torchrun puts it, with its text and the time it was last written."""
    for rank, (text, written_s) in said.items():
        log = log_dir / "hetplan-run" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)
        os.utime(log, (written_s, written_s))


def test_the_rank_that_failed_first_is_named_with_its_own_error_not_a_peer_s(two_rank_plan, tmp_path):
    _, p = two_rank_plan
    log_dir = tmp_path / "run" / "logs"
    now = time.time()
    _rank_logs(log_dir, {0: ("train.py: rank 0: RuntimeError: gloo: Connection closed by peer\n", now),
                         1: ("train.py: rank 1 ran out of memory\n", now - 0.2),
                         2: ("", now - 30)})                     # stopped by torchrun: wrote nothing late
    assert first_failure(REPORT, log_dir, world_size=3) == (1, 1)
    only_sigterm = REPORT.replace("exitcode  : 1 (pid: 101)", "exitcode  : -15 (pid: 101)").replace(
        "exitcode  : 1 (pid: 102)", "exitcode  : -15 (pid: 102)")
    assert first_failure(only_sigterm, log_dir, world_size=3) == (0, -15)   # then torchrun's root cause
    assert first_failure("no report", log_dir, world_size=3) is None
    # a rank that stopped because of a peer (its exit code says so) is passed over, though it wrote first
    for_peer = REPORT.replace("exitcode  : 1 (pid: 102)", f"exitcode  : {FOR_PEER_EXIT_CODE} (pid: 102)")
    assert first_failure(for_peer, log_dir, world_size=3) == (0, 1)

    (log_dir / "launcher.log").write_text(REPORT.replace("rank      : 2 (local_rank: 2)", "rank      : 9"))
    line = failure_line(p, tmp_path / "run", returncode=1)
    replica, stage = p.stage_of_rank(1)
    assert line.startswith(f"plan run: rank 1 (replica {replica.index} stage {stage.index} on {stage.device_label}, "
                           f"{stage.device_type}) exited with code 1 before its first step: "
                           "train.py: rank 1 ran out of memory; the other ranks were stopped"), line


def test_the_step_time_line_says_when_a_rebalance_changed_the_shares(two_rank_plan, tmp_path):
    _, p = two_rank_plan
    path = tmp_path / metrics.METRICS_FILE
    report, printed = _report(p, tmp_path, every_s=0.0, steps=6)
    for step in range(6):
        for rank in (0, 1):      # rank 0's line records a rebalance at step 2 (applied) and 4 (refused)
            applied = {2: "true", 4: "false"}.get(step) if rank == 0 else None
            _append(path, rank, step, 1.0, 0.1 + step / 100, MIB,
                    f', "rebalance": {{"applied": {applied}}}' if applied else "")
        report.poll()
    report.finish(tmp_path / "logs")
    step_time = next(ln for ln in printed if ln.startswith("plan run: step time"))
    assert "median of steps 3-5" in step_time
    assert "the shares changed after step 2 (--rebalance): the estimate is for the planned ones" in step_time


def test_a_resumed_runs_step_time_counts_its_own_steps(two_rank_plan, tmp_path):
    _, p = two_rank_plan
    path = tmp_path / metrics.METRICS_FILE
    for step in range(6):                      # the earlier run's steps 0-5, slow
        for rank in (0, 1):
            _append(path, rank, step, 1.0, 9.0, MIB)
    report, printed = _report(p, tmp_path, every_s=0.0, steps=10)
    for step in range(4, 10):                  # resumed from its step 4 checkpoint: steps 4-9, fast
        for rank in (0, 1):
            _append(path, rank, step, 1.0, 0.5 if step < 7 else 0.1, MIB)
        report.poll()
    report.finish(tmp_path / "logs")
    step_time = next(ln for ln in printed if ln.startswith("plan run: step time"))
    assert "0.100/" in step_time and "median of steps 7-9" in step_time     # its own first 3 steps warm up
    assert printed[-1].startswith("plan run: 10 step(s); ")


def test_a_gpu_plan_run_on_cpu_says_its_estimates_are_for_the_gpus(two_rank_plan, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a machine with a GPU the plan's GPU ranks run there")
    _, p = two_rank_plan
    on_a100 = dataclasses.replace(p, replicas=tuple(dataclasses.replace(r, stages=tuple(
        dataclasses.replace(st, device_type="A100-40GB") for st in r.stages)) for r in p.replicas))
    path = tmp_path / metrics.METRICS_FILE
    report, printed = _report(on_a100, tmp_path, every_s=0.0, steps=4)
    _log_steps(report, path, range(4))
    report.finish(tmp_path / "logs")
    memory = next(ln for ln in printed if ln.startswith("plan run: peak memory"))
    assert memory.endswith(" MiB (CPU processes stood in for the plan's A100-40GB: the estimates are for those "
                           "devices)")
    step_time = next(ln for ln in printed if ln.startswith("plan run: step time"))
    assert step_time.endswith("CPU processes stood in for the plan's A100-40GB (no GPU here): the estimate is for "
                              "those devices")
