"""Why a `plan run` launch failed, from what torchrun and the ranks left on disk: the rank that failed
first, its device, how it ended, its last completed step and the last line it wrote (`failure_line`);
and which rank failed in each attempt of a launch that torchrun restarted (`attempt_failures`, read by
the elastic supervisor).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from planner.core.ir import Plan

from .program.metrics import METRICS_FILE, read_metrics
from .program.placement import printable
from .program.process_group import FOR_PEER_EXIT_CODE

LAUNCHER_LOG = "launcher.log"
LOG_DIR = "logs"
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:(?P<body>.*?)(?:\n=|\Z)", re.S)
ATTEMPT_FAILED = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<rank>\d+)")
FAILURE = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+).*?^\s*exitcode\s*:\s*(?P<code>-?\d+)", re.M | re.S)


def failure_line(plan: Plan, run_dir: Path, returncode: int) -> str:
    """One line for a failed run: the rank that failed first (`first_failure`), or torchrun's own end."""
    log_dir = run_dir / LOG_DIR
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return (f"plan run: the torchrun agent was killed by {name}; its workers stopped with it "
                f"(logs: {log_dir})")
    launcher = (log_dir / LAUNCHER_LOG).read_text(errors="replace") if (log_dir / LAUNCHER_LOG).exists() else ""
    first = first_failure(launcher, log_dir, plan.world_size)
    if first is None:
        return f"plan run: torchrun exited with code {returncode} (logs: {log_dir}/{LAUNCHER_LOG})"
    rank, code = first
    replica, stage = plan.stage_of_rank(rank)
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    steps = [m["step"] for m in _metrics(run_dir) if m.get("rank") == rank]
    when = f"after step {max(steps)}" if steps else "before its first step"
    stderr_log = _rank_log(log_dir, rank)
    said = _last_line(stderr_log) if stderr_log else ""
    return (f"plan run: rank {rank} (replica {replica.index} stage {stage.index} on "
            f"{printable(stage.device_label)}, {printable(stage.device_type)}) {how} {when}"
            f"{': ' + said if said and code > 0 else ''}; the other ranks were stopped "
            f"(logs: {stderr_log or log_dir})")


def first_failure(launcher: str, log_dir: Path, world_size: int) -> tuple[int, int] | None:
    """(rank, exit code) of the rank whose failure came first, from torchrun's failure report in
    `launcher` (its log), or None when it has none.

    torchrun's "first observed failure" is the earliest by whole seconds, so a peer that failed in the same
    second because of it (a receive that found the connection closed) may be named instead. So: of the
    ranks the report lists, not those ended by SIGTERM (how torchrun stops the others) or that stopped
    because of a peer (FOR_PEER_EXIT_CODE), the one whose own log was written last the earliest: the rank
    that failed first wrote its last line (an error, or nothing more once killed) before any peer could
    see it gone."""
    found = ROOT_CAUSE.search(launcher)
    root = FAILURE.search(found.group("body")) if found else None
    if found is None or root is None:
        return None
    report = launcher[launcher.rfind("Failures:"):] if "Failures:" in launcher else found.group(0)
    failures = {int(m["rank"]): int(m["code"]) for m in FAILURE.finditer(report)}
    failures[int(root["rank"])] = int(root["code"])
    failures = {rank: code for rank, code in failures.items() if rank < world_size}
    if not failures:
        return None
    own = {rank: code for rank, code in failures.items() if code not in (-signal.SIGTERM, FOR_PEER_EXIT_CODE)}
    if not own:
        return int(root["rank"]), int(root["code"])

    def last_written_ns(rank: int) -> int:
        log = _rank_log(log_dir, rank)
        return log.stat().st_mtime_ns if log is not None else 0
    rank = min(own, key=lambda r: (last_written_ns(r), r))
    return rank, own[rank]


def attempt_failures(launcher: str) -> list[tuple[int, int]]:
    """(rank, exit code) of each failed attempt of a torchrun launch, in order, from its log `launcher`:
    torchrun names the first failure it observed of each attempt ("failed (exitcode: C) local_rank: R";
    on one machine the local rank is the plan rank). A rank stopped by a peer's failure waits before it
    exits (process_group.FOR_PEER_EXIT_DELAY_S), so the rank named is the one that failed."""
    return [(int(m["rank"]), int(m["code"])) for m in ATTEMPT_FAILED.finditer(launcher)]


def launcher_text(run_dir: Path) -> str:
    """The log of the latest torchrun launch in `run_dir` ('' when there is none)."""
    path = run_dir / LOG_DIR / LAUNCHER_LOG
    return path.read_text(errors="replace") if path.exists() else ""


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    return read_metrics(path) if path.exists() else []


def _rank_log(log_dir: Path, rank: int) -> Path | None:
    """torchrun's stderr log of `rank` (on one machine its local rank): <log_dir>/<run>/attempt_<k>/<rank>/."""
    found = list(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))     # the latest launch's last attempt
    return max(found, key=lambda log: log.parent.parent.stat().st_mtime_ns) if found else None


def _last_line(path: Path, most_chars: int = 600) -> str:
    """The last line a rank wrote to its log, without torchrun's `[rankN]:` prefix."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln.strip()) for ln in path.read_text(errors="replace").splitlines()]
    lines = [ln for ln in lines if ln]
    return printable(lines[-1][:most_chars]) if lines else ""
