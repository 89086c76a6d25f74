"""`plan run`'s engine: the emitted program on this machine under torchrun, reachable from this machine
only, stopped whole by a signal, and one line when a rank dies.

- Nothing listens beyond 127.0.0.1. A torch TCPStore server listens on every interface unless it is
  handed a socket already bound, so this process binds one to 127.0.0.1, serves the store on it
  (LoopbackStore) and torchrun joins it as a client (c10d rendezvous, `is_host=false`); the workers'
  process group forms over the same store (HETPLAN_STORE, see program/process_group.py) instead of a
  second server of torchrun's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and gloo binds to loopback
  (GLOO_SOCKET_IFNAME=lo).
- Nothing outlives the run. torchrun runs in a session of its own under a lifeline (program/lifeline.py):
  killed when this process exits, however it exits; each worker dies with torchrun in turn. SIGTERM or
  SIGINT here is passed on to torchrun as SIGTERM, which stops its workers; after GRACE_S it is killed.
- Deaths are one line. Every rank's output goes to `<run>/logs/` (torchrun --log-dir, --redirects,
  --tee; the agent's own log to launcher.log); a failed run is summed up by torchrun's first observed
  failure: the rank, its device, how it ended, its last completed step (from metrics.jsonl) and the
  last line it wrote.
- Nothing is lost. An earlier `<out>/run` moves to `<out>/runs/<n>` first (keep_previous_run).
- Start-up shows. On a terminal a status line follows torchrun, then its workers, until the first step's
  metrics are written (backends.report.progress; nothing at all when stderr is not a terminal).
- Training shows. Each step that every rank has logged is one plain line (step, loss, the slowest rank's
  step time, samples per second), at most one per PRINT_EVERY_S when steps are faster; at the end each
  rank's measured peak memory beside the plan's estimate, the measured step time beside the plan's
  (`step_time_line`: the median after the warm-up steps, and by how much the estimate misses), and where
  the metrics and the logs are (StepReport: plain lines, fine in a pipe and a log).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch.distributed as dist

from backends.report.progress import Progress
from costmodel.placeholders import noted_device_type
from planner.core.errors import printable
from planner.core.ir import Plan

from .program.memory import EMULATE_ENV
from .program.metrics import METRICS_FILE, MetricsFollower
from .program.placement import emulated_device_types
from .program.process_group import STORE_ENV
from .run_failures import LAUNCHER_LOG, LOG_DIR, failure_line

GRACE_S = 5.0                 # after a forwarded signal, torchrun's time to stop its workers
POLL_S = 0.2
PRINT_EVERY_S = 2.0           # steps faster than this print one line per this many seconds (and the last)
MEMORY_LISTED_RANKS = 8       # the end's memory line names every rank up to this many, else the fullest
MIB_BYTES = 1 << 20
STEP_TIME_WARMUP = 3          # first steps left out of the measured step time (tracing, first-touch allocation)
HETPLAN_ROOT = Path(__file__).resolve().parents[2]   # the folder holding planner/, backends/, ...


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended: the exit code for `plan run`, and its one line (None after a clean run)."""

    returncode: int
    message: str | None


def keep_previous_run(run_dir: Path) -> Path | None:
    """Move an earlier run folder aside to `<parent>/runs/<n>` (n = 1, 2, ...); returns where it went."""
    if not run_dir.exists():
        return None
    runs = run_dir.parent / "runs"
    runs.mkdir(exist_ok=True)
    taken = [int(p.name) for p in runs.iterdir() if p.name.isdigit()]
    target = runs / str(max(taken, default=0) + 1)
    run_dir.rename(target)
    return target


class LoopbackStore:
    """A c10d TCPStore served on 127.0.0.1 only (on a socket bound here, so on a free port)."""

    def __init__(self, timeout_s: float) -> None:
        listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listening.bind(("127.0.0.1", 0))
        listening.listen(256)
        self.port = int(listening.getsockname()[1])
        # the store owns the descriptor from here on (and closes it with the server)
        self._store: dist.TCPStore | None = dist.TCPStore(
            "127.0.0.1", self.port, is_master=True, wait_for_workers=False, multi_tenant=True,
            timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listening.detach())

    def close(self) -> None:
        self._store = None


RANK_LINE_PREFIX = "[rank ${rank}] "


def torchrun_command(program_dir: Path, world_size: int, store_port: int, run_id: str, log_dir: Path,
                     train_args: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun on one machine over the loopback store, under a lifeline to this process; it restarts the
    whole group up to `max_restarts` times after a worker fails (the program then resumes by itself from
    its last complete checkpoint)."""
    return [sys.executable, "-m", "backends.torchdist.program.lifeline", str(os.getpid()),
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store_port}", "--rdzv-id", run_id,
            "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts),
            "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3",
            str(program_dir / "train.py"), *train_args]


def run_environment(store_port: int, base: dict[str, str] | None = None, *,
                    emulate_memory: bool = False) -> dict[str, str]:
    """The environment torchrun and the workers run in (loopback, one thread each, hetplan importable;
    with `emulate_memory`, CPU ranks held to their device's memory: program/memory.py)."""
    env = dict(os.environ if base is None else base)
    env[STORE_ENV] = f"127.0.0.1:{store_port}"
    if emulate_memory:
        env[EMULATE_ENV] = "1"
    else:
        env.pop(EMULATE_ENV, None)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"   # no second store server of torchrun's own
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    # the ranks' lines on the console start with the rank (one agent here: torchrun's rank is the plan's), not
    # torchrun's "[default0]:" (its role name and local rank)
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_LINE_PREFIX)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HETPLAN_ROOT), path) if p)
    return env


def run_program(plan: Plan, program_dir: Path, run_dir: Path, train_args: list[str], *,
                timeout_s: float, progress: Progress | None = None, emulate_memory: bool = False,
                report: TextIO | None = None, steps: int | None = None, max_restarts: int = 0) -> RunOutcome:
    """Run the program of `plan` for `train_args` with its output in `run_dir` (a run resumed in place
    may find it there: its metrics are appended to); `progress` shows the start-up until the first step
    (closed then); `report` gets a line per step (StepReport; `steps`: how many the run makes) and the
    run's memory, metrics and logs at its end. torchrun restarts the group up to `max_restarts` times."""
    log_dir = run_dir / LOG_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    _keep_launcher_log(log_dir)
    run_id = f"hetplan-{uuid.uuid4().hex[:12]}"
    store = LoopbackStore(timeout_s)
    received: list[int] = []
    steps_report = StepReport(plan, run_dir, report, steps) if report is not None else None
    try:
        with open(log_dir / LAUNCHER_LOG, "wb") as launcher_log:
            proc = subprocess.Popen(
                torchrun_command(program_dir, plan.world_size, store.port, run_id, log_dir,
                                 [*train_args, "--out", str(run_dir), "--timeout", str(timeout_s)], max_restarts),
                stdout=None, stderr=launcher_log, stdin=subprocess.DEVNULL, start_new_session=True,
                env=run_environment(store.port, emulate_memory=emulate_memory))
            polls = (_start_up(progress, plan.world_size, run_dir), steps_report.poll if steps_report else None)
            returncode = _wait(proc, received, [poll for poll in polls if poll is not None])
    finally:
        store.close()
    if steps_report is not None:
        steps_report.finish(log_dir)
    if received:
        name = signal.Signals(received[0]).name
        return RunOutcome(128 + received[0], f"plan run: stopped by {name}: torchrun and its workers were "
                                             f"stopped (logs: {log_dir})")
    if returncode == 0:
        return RunOutcome(0, None)
    return RunOutcome(1, failure_line(plan, run_dir, returncode))


@dataclass(frozen=True)
class StepLine:
    """One step every rank has logged."""

    step: int                 # as in metrics.jsonl (from 0)
    loss: float
    step_time_s: float        # the slowest rank's
    samples_s: float          # the global batch over that time


class StepReport:
    """`plan run`'s plain lines on `stream`: a step once every rank logged it (read from metrics.jsonl as
    the ranks append to it), at most one line per `every_s` (the newest step then; the run's last step
    always), and at the end each rank's peak memory and the step time beside the plan's estimates and
    where the metrics and the logs are."""

    def __init__(self, plan: Plan, run_dir: Path, stream: TextIO, steps: int | None = None,
                 every_s: float = PRINT_EVERY_S) -> None:
        self.plan, self.stream, self.steps, self.every_s = plan, stream, steps, every_s
        self.metrics_path = run_dir / METRICS_FILE
        self._follower = MetricsFollower(self.metrics_path)
        # step -> rank -> its record of it (a step run again after a restart: the newest record)
        self._logged: dict[int, dict[int, dict[str, Any]]] = {}
        self._newest: StepLine | None = None
        self._printed_step = -1
        self._printed_at_s = -float("inf")
        self._peak_bytes: dict[int, int] = {}                  # rank -> its highest measured peak
        self._step_times_s: dict[int, float] = {}              # step -> the slowest rank's time (newest run of it)
        self._rebalanced_after: set[int] = set()               # steps after which new shares were applied
        # what the file holds already (a resumed run's earlier steps): shown, but not this run's step time
        self._earlier = self._follower.new_records()

    def poll(self) -> None:
        """Take the lines added since the last poll; print the newest complete step when one is due."""
        earlier, self._earlier = self._earlier, []
        for fresh, record in [(False, r) for r in earlier] + [(True, r) for r in self._follower.new_records()]:
            step, rank = record.get("step"), record.get("rank")
            if not isinstance(step, int) or not isinstance(rank, int):
                continue
            self._note_memory(rank, record)
            rebalance = record.get("rebalance")
            if isinstance(rebalance, dict) and rebalance.get("applied"):
                self._rebalanced_after.add(step)
            records = self._logged.setdefault(step, {})
            records[rank] = record
            if len(records) == self.plan.world_size:
                del self._logged[step]
                line = self._step_line(step, list(records.values()))
                if fresh:
                    self._step_times_s[step] = line.step_time_s
                if self._newest is None or step > self._newest.step:
                    self._newest = line
        last = self.steps is not None and self._newest is not None and self._newest.step == self.steps - 1
        if last or time.monotonic() - self._printed_at_s >= self.every_s:
            self._print_newest()

    def finish(self, log_dir: Path) -> None:
        """The lines of a run that ended: its last step, the memory per rank, the metrics and the logs."""
        self.poll()
        self._print_newest()
        emulated = emulated_device_types(self.plan)
        if self._peak_bytes:
            stood_in = f" ({stood_in_for(emulated)}: the estimates are for those devices)" if emulated else ""
            self._write(f"plan run: peak memory (measured / the plan's estimate): {self.memory_summary()}{stood_in}")
        step_time = step_time_line(self.plan, self._step_times_s, sorted(self._rebalanced_after), emulated)
        if step_time is not None:
            self._write(step_time)
        done = f"{self._printed_step + 1} step(s); " if self._printed_step >= 0 else "no step completed; "
        self._write(f"plan run: {done}metrics: {self.metrics_path}; logs: {log_dir}")

    def memory_summary(self) -> str:
        """`rank 0 398/459 MiB, rank 1 ...`: every rank's peak beside its estimate (the fullest only,
        by peak over estimate, when more than MEMORY_LISTED_RANKS ranks logged)."""
        ranks = sorted(self._peak_bytes)
        if len(ranks) > MEMORY_LISTED_RANKS:
            fullest = max(ranks, key=lambda r: self._peak_bytes[r] / max(self.plan.estimates.memory_bytes[r], 1.0))
            return f"{self._rank_memory(fullest)} (the fullest of {len(ranks)} ranks)"
        return ", ".join(self._rank_memory(r) for r in ranks)

    def _rank_memory(self, rank: int) -> str:
        return (f"rank {rank} {self._peak_bytes[rank] / MIB_BYTES:,.0f}/"
                f"{self.plan.estimates.memory_bytes[rank] / MIB_BYTES:,.0f} MiB")

    def _note_memory(self, rank: int, record: dict[str, Any]) -> None:
        peak = record.get("peak_reserved_bytes") or record.get("peak_memory_bytes")
        if isinstance(peak, (int, float)) and rank < self.plan.world_size:
            self._peak_bytes[rank] = max(self._peak_bytes.get(rank, 0), int(peak))

    def _step_line(self, step: int, records: list[dict[str, Any]]) -> StepLine:
        times_s = [float(r["step_time_s"]) for r in records if isinstance(r.get("step_time_s"), (int, float))]
        step_time_s = max(times_s, default=0.0)
        loss = next((float(r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))), float("nan"))
        samples_s = self.plan.global_batch / step_time_s if step_time_s > 0 else float("inf")
        return StepLine(step, loss, step_time_s, samples_s)

    def _print_newest(self) -> None:
        line = self._newest
        if line is None or line.step <= self._printed_step:
            return
        count = f" ({line.step + 1}/{self.steps})" if self.steps else ""
        self._write(f"step {line.step}{count}: loss {line.loss:.4f}, {line.step_time_s:.3f} s/step, "
                    f"{line.samples_s:,.1f} samples/s")
        self._printed_step, self._printed_at_s = line.step, time.monotonic()

    def _write(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):    # the reader went away (a closed pipe): the run goes on silently
            pass


def stood_in_for(emulated: Sequence[str]) -> str:
    """`CPU processes stood in for the plan's A100-40GB`: the device types a run here only emulated."""
    return f"CPU processes stood in for the plan's {', '.join(printable(t) for t in emulated)}"


def step_time_line(plan: Plan, step_times_s: dict[int, float], rebalanced_after: Sequence[int] = (),
                   emulated: Sequence[str] = ()) -> str | None:
    """`plan run: step time (measured / the plan's estimate): ...`: the median of the slowest rank's step
    time over the steps after the first STEP_TIME_WARMUP (at least the last step is kept) beside the plan's
    estimate, and by how much the estimate misses; None under two steps (the first one traces). Where
    --rebalance changed the shares (after the steps `rebalanced_after`), it says so: the estimate is the
    planned shares'; where CPU processes stood in for the plan's devices (`emulated` types: no GPU here),
    the estimate is for those devices and no miss is claimed."""
    steps = sorted(step_times_s)
    if len(steps) < 2:
        return None
    kept = steps[min(STEP_TIME_WARMUP, len(steps) - 1):]
    measured_s, estimate_s = statistics.median(step_times_s[s] for s in kept), plan.estimates.iteration_s
    span = f"step {kept[0]}" if len(kept) == 1 else f"steps {kept[0]}-{kept[-1]}"
    line = (f"plan run: step time (measured / the plan's estimate): {measured_s:.3f}/{estimate_s:.3f} s "
            f"(the slowest rank's, median of {span})")
    if emulated:
        return f"{line}; {stood_in_for(emulated)} (no GPU here): the estimate is for those devices"
    if measured_s > 0:
        off = estimate_s / measured_s - 1.0
        line += f", the estimate {abs(off):.0%} {'over' if off >= 0 else 'under'}"
    if rebalanced_after:
        line += (f"; the shares changed after step {', '.join(map(str, rebalanced_after))} (--rebalance): the "
                 "estimate is for the planned ones")
    if any(noted_device_type(w) is not None for w in plan.warnings):
        line += "; it rests on placeholder figures: `plan profile`, then plan with --calibration FILE"
    return line


class _Forwarder:
    """Passes SIGTERM / SIGINT on to torchrun's process group while installed; a second signal kills it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.received: list[int] = []
        self.first_at_s = 0.0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.first_at_s = time.monotonic()
        self.received.append(signum)
        self.kill(signal.SIGTERM if len(self.received) == 1 else signal.SIGKILL)

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass


def _start_up(progress: Progress | None, world_size: int, run_dir: Path) -> Callable[[], None] | None:
    """What `_wait` calls at each poll to show the start-up: torchrun starting, then its workers (their
    log folders are there), until the first step's metrics are written; None when nothing shows."""
    if progress is None or not progress.enabled:
        return None
    status = progress

    def poll() -> None:
        if (run_dir / METRICS_FILE).exists():
            status.close()
        elif any((run_dir / LOG_DIR).glob("*/attempt_*/*")):
            status.phase(f"start-up: {world_size} worker(s) import, join, trace stages")
        else:
            status.phase("start-up: torchrun")
    poll()
    return poll


def _wait(proc: subprocess.Popen, received: list[int], polls: Sequence[Callable[[], None]] = ()) -> int:
    """Wait for torchrun, passing SIGTERM / SIGINT on; kill it GRACE_S after the first one. The signals
    received are appended to `received`; each of `polls` is called between polls, in order. A SIGINT this
    process inherited ignored stays ignored (a background job of a shell without job control is started so,
    that a Ctrl-C meant for the foreground spares it), as `plan` keeps it (planner.core.interrupts)."""
    forwarder = _Forwarder(proc.pid)
    handled = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
    previous = {s: signal.signal(s, forwarder) for s in handled}
    try:
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            for poll in polls:
                poll()
            if forwarder.received and time.monotonic() - forwarder.first_at_s > GRACE_S:
                forwarder.kill(signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        received.extend(forwarder.received)


def _keep_launcher_log(log_dir: Path) -> None:
    """A run resumed in place: the earlier launch's log moves to launcher.<n>.log (n = 1, 2, ...)."""
    path = log_dir / LAUNCHER_LOG
    if path.exists():
        taken = len(list(log_dir.glob("launcher.*.log")))
        path.rename(log_dir / f"launcher.{taken + 1}.log")
