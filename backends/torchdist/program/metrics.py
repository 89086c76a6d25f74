"""Per-step metrics: one JSON line per step and rank, appended to `<out>/metrics.jsonl`.

Every rank appends to the same file, so each line is one `os.write` of the whole line on a descriptor
opened with O_APPEND: lines of different ranks never interleave. A full disk must not leave a torn line
behind: a short write is truncated away again (when no other rank appended after it) and the run stops
with one line saying so. `read_metrics` skips what a torn write can still leave: an incomplete last
line, or a line that is not a JSON record; `MetricsFollower` reads the lines added since its last read
(`plan run`'s progress).

Each line also holds this rank's memory, added by `MetricsLog.log` itself: the measured peak
(memory.peak_memory_fields: VmHWM on CPU, the CUDA allocator's allocated and reserved peaks) beside
the plan's estimate for the rank (`estimated_memory_bytes`, its stage's `memory_bytes`).

Each line holds the rank's compute of the step as well (slowdown.Slowdown: forward and backward with an
emulated device's padding): `compute_s` in CPU seconds on a CPU device (wall seconds on a GPU), and
`compute_wall_s`, the wall seconds it took; beside the plan's `busy_s` of the rank they tell compute
estimates from waiting, and on a shared CPU host how much the other processes slowed it.

A run with --rebalance (rebalance.py) adds to every line the replicas' measured compute seconds per row
(`replica_s_per_row`), and to the lines of a step after which it re-solved the batch shares a
`rebalance` record (`RebalanceRecord`): the step, the old and the new shares, the figures the solver saw,
whether the new shares were applied from the next step, and why not when they were refused.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from planner.core.errors import HetplanError

from .memory import peak_memory_fields
from .process_group import Context

METRICS_FILE = "metrics.jsonl"


class MetricsWriteError(HetplanError):
    """A metrics line could not be written whole (full disk, file size limit, I/O error)."""

    exit_code = 1


def append_line(fd: int, line: bytes, path: str) -> None:
    """Append `line` (ending in a newline) to `fd` (O_APPEND) in one write; on a short write remove the
    partial line again and raise MetricsWriteError, as on any write error."""
    try:
        written = os.write(fd, line)
    except OSError as exc:
        raise MetricsWriteError(f"writing a metrics line failed: {os.strerror(exc.errno or errno.EIO)}",
                                file=path, fix="free disk space or pass --out a folder with room") from exc
    if written == len(line):
        return
    end = os.lseek(fd, 0, os.SEEK_CUR)          # O_APPEND: just after the bytes this write added
    removed = os.fstat(fd).st_size == end       # another rank appended since: leave its line alone
    if removed:
        os.ftruncate(fd, end - written)
    raise MetricsWriteError(f"the disk took {written} of the {len(line)} bytes of a metrics line "
                            f"({'removed again' if removed else 'left torn'})", file=path,
                            fix="free disk space or pass --out a folder with room")


@dataclass(frozen=True)
class RebalanceRecord:
    """One re-solve of the batch shares, as every rank logs it on the line of `step`."""

    step: int                           # the last step on the old shares; the new ones train from step + 1
    old_shares: tuple[int, ...]         # rows per replica, plan order
    new_shares: tuple[int, ...]
    new_micro_batch_sizes: tuple[tuple[int, ...], ...]   # per replica, its new shares' micro-batches
    seconds_per_row: tuple[float, ...]  # per replica, as the solver saw it (window medians, rebalance.speeds_of)
    seconds_per_micro_batch: tuple[float, ...]
    predicted_old_s: float              # the slowest replica's predicted step time on the old shares
    predicted_new_s: float              # ... on the new ones
    applied: bool
    refused: str | None = None          # why the new shares were not applied (their communication)

    def fields(self) -> dict[str, Any]:
        """The record as a metrics line's `rebalance` field."""
        return {"rebalance": asdict(self)}


class MetricsLog:
    """This rank's metrics lines: rank, replica, stage and device, the step's fields, then the rank's
    measured peak memory and the plan's estimate of it."""

    def __init__(self, out_dir: Path, ctx: Context) -> None:
        self.path = out_dir / METRICS_FILE
        self.ctx = ctx
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise MetricsWriteError(f"cannot open the metrics file: {exc.strerror}", file=str(self.path),
                                    fix="pass --out a folder this user may write") from exc

    def log(self, **fields: Any) -> None:
        record = {"rank": self.ctx.rank, "replica": self.ctx.replica.index, "stage": self.ctx.stage.index,
                  "device": self.ctx.stage.device_label, **fields, **peak_memory_fields(self.ctx.device),
                  "estimated_memory_bytes": self.ctx.stage.memory_bytes}
        append_line(self._fd, (json.dumps(record) + "\n").encode(), str(self.path))

    def close(self) -> None:
        os.close(self._fd)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, skipping an incomplete last line and any line that is not a JSON
    record (what a torn write leaves)."""
    lines = Path(path).read_bytes().split(b"\n")[:-1]   # after the last newline: nothing, or an incomplete line
    return _records(lines)


class MetricsFollower:
    """Reads a metrics.jsonl as ranks append to it: each `new_records` returns the records of the lines
    completed since the last call (an incomplete last line waits for its end; a missing file has none)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return _records(complete.split(b"\n")[:-1])


def _records(lines: list[bytes]) -> list[dict[str, Any]]:
    """The JSON records among `lines`, skipping any that is not one (a torn write's remains)."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
