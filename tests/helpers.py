"""Shared test helpers: paths, planning into a temp dir, running emitted programs."""

from __future__ import annotations

import datetime
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CLUSTERS = EXAMPLES / "clusters"
SHARED_CLUSTERS = REPO.parent / "shared" / "clusters"
BENCHMARKS = REPO / "benchmarks"


@contextmanager
def sigint_handled_by(handler: Any) -> Iterator[None]:
    """SIGINT's disposition set to `handler` in the body (a child started there inherits SIG_IGN or SIG_DFL
    across exec), the one before it put back after."""
    before = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def import_benchmark(name: str) -> Any:
    """Import the script benchmarks/<name>.py the way it runs (its sibling imports, such as `common`,
    resolve in benchmarks/), then take benchmarks/ off sys.path again: left there, its file names would
    shadow installed packages of the same name for every later test of the worker."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def cluster_files() -> list[Path]:
    """Every spec in ../shared/clusters (falls back to the bundled copies)."""
    folder = SHARED_CLUSTERS if SHARED_CLUSTERS.is_dir() else CLUSTERS
    return sorted(folder.glob("*.yaml"))


def run_plan_cli(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def run_program(out: Path, steps: int, *, seed: int = 0, lr: float = 1e-3, timeout_s: float = 300,
                save_final: bool = True, optimizer: str = "adamw", collective_timeout_s: float = 60,
                extra: tuple[str, ...] = ()) -> list[dict]:
    """`plan run OUT` with a short collective timeout; returns the metrics lines of OUT/run."""
    # the program's workers import this checkout's packages whether or not it is installed
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "planner.cli", "run", str(out), "--steps", str(steps), "--seed", str(seed),
           "--lr", str(lr), "--optimizer", optimizer, "--timeout", str(collective_timeout_s)]
    cmd += ["--save-final"] if save_final else []
    cmd += list(extra)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + run_logs_tail(out)
    return read_metrics(out / "run" / "metrics.jsonl")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (the program's reader: an incomplete last line is skipped)."""
    from backends.torchdist.program.metrics import read_metrics as read

    return read(path)


def run_logs_tail(out: Path, most_chars: int = 4000) -> str:
    """The end of every log of OUT/run (torchrun's own and each rank's stderr), for a failure message."""
    logs = out / "run" / "logs"
    parts = []
    for path in sorted(logs.rglob("*.log")) if logs.is_dir() else []:
        text = path.read_text(errors="replace").strip()
        if text:
            parts.append(f"\n--- {path.relative_to(logs)}\n{text[-most_chars:]}")
    return "".join(parts)


def spawn_gloo_workers(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int, *,
                       deadline_s: float, store_timeout_s: float = 60.0) -> None:
    """Run `worker(rank, store_port, *args)` on `nprocs` spawned processes; every child is reaped,
    also on failure or timeout.

    The rendezvous store lives in this process and binds port 0 itself, so the free port is chosen
    by the kernel and held from the start (no pick-then-bind race between tests).
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=store_timeout_s))
    context = mp.start_processes(worker, args=(store.port, *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1.0):          # raises if a worker failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker.__name__} did not finish in {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        del store
