"""Checkpoints of the emitted program: where they lie, when one counts, and saving them with
torch.distributed.checkpoint (DCP), asynchronously by default.

Layout: `<root>/step_<N>/` holds the state after N completed steps (N is the next step to run): DCP's
per-rank data files, its `.metadata` (written last, by rank 0, once every rank's data is written) and
then `COMPLETE`, a JSON marker (step, plan digest, world size, time) that rank 0 writes through a
temporary sibling and `os.replace` after its save finished. Only a folder with both counts
(`is_complete`): a crash during a save leaves a folder without them, and the previous one stays the
latest (`latest_complete`). After a new one completes, rank 0 deletes the complete ones older than
the newest `keep` (`prune`); incomplete folders are left for a person to look at.

`Checkpointer.save` stages a CPU copy of the state (the only part that blocks the step) and writes it
in a background thread (`dcp.async_save`), over a gloo group of its own so that the training's
collectives on the default group never interleave with DCP's; `--sync-checkpoint` writes in the step
instead. At most one save is in flight: the next one, and the end of the run, wait for it. What the
state holds, and loading it into a rank of any plan of the model, is checkpoint_state.py.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from planner.core.errors import HetplanError

CHECKPOINT_DIR = "ckpt"              # under the run's --out, unless --checkpoint-dir says otherwise
STEP_PREFIX = "step_"
COMPLETE_FILE = "COMPLETE"
METADATA_FILE = ".metadata"          # DCP's own, written after every rank's data
DEFAULT_KEEP = 3
_STEP_FOLDER = re.compile(rf"^{STEP_PREFIX}(\d+)$")


class CheckpointError(HetplanError):
    """A checkpoint cannot be found, read or written, or does not hold what this rank needs."""

    exit_code = 1


def step_folder(root: Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step` completed steps."""
    return root / f"{STEP_PREFIX}{step}"


def step_of(folder: Path) -> int:
    """N of a `step_<N>` folder (CheckpointError for any other name)."""
    found = _STEP_FOLDER.match(folder.name)
    if found is None:
        raise CheckpointError(f"{folder.name!r} is not a checkpoint folder", file=str(folder),
                              fix=f"pass a checkpoint root or one {STEP_PREFIX}<N> folder in it")
    return int(found[1])


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The COMPLETE marker of `folder`, or None where there is none (or it is unreadable)."""
    try:
        marker = json.loads((folder / COMPLETE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(folder: Path) -> bool:
    """Whether `folder` is a whole checkpoint: DCP's metadata and the COMPLETE marker of its step."""
    if _STEP_FOLDER.match(folder.name) is None or not (folder / METADATA_FILE).is_file():
        return False
    marker = read_marker(folder)
    return marker is not None and marker.get("step") == step_of(folder)


def complete_folders(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (none where `root` does not exist)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def latest_complete(root: Path) -> Path | None:
    """The complete checkpoint of the most steps under `root`, or None."""
    folders = complete_folders(root)
    return folders[-1] if folders else None


def resolve(path: Path) -> Path:
    """The checkpoint `--resume-from PATH` names: a `step_<N>` folder (complete), or a root's latest
    complete one; CheckpointError otherwise."""
    if _STEP_FOLDER.match(path.name) is not None:
        if not is_complete(path):
            raise CheckpointError("this checkpoint is not complete (no COMPLETE marker or no .metadata: its "
                                  "save did not finish)", file=str(path),
                                  fix="pass an earlier step_<N> folder or the checkpoint root")
        return path
    latest = latest_complete(path)
    if latest is None:
        raise CheckpointError("no complete checkpoint here", file=str(path),
                              fix="pass a folder holding step_<N> checkpoints, or start without resuming")
    return latest


def write_marker(folder: Path, step: int, plan_digest: str, world_size: int) -> Path:
    """Mark `folder` complete: the JSON marker through a temporary sibling and os.replace (atomic)."""
    marker = {"step": step, "plan_digest": plan_digest, "world_size": world_size,
              "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    temporary = folder / f".{COMPLETE_FILE}.tmp"
    with open(temporary, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / COMPLETE_FILE)
    return folder / COMPLETE_FILE


def prune(root: Path, keep: int) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep`; the folders deleted."""
    old = complete_folders(root)[:-keep] if keep > 0 else []
    for folder in old:
        shutil.rmtree(folder, ignore_errors=True)
    return old


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer that calls `after_data()` once this rank's data files are written, before the
    save completes (the `crash-in-save` fault dies there: data on disk, no .metadata, no marker)."""

    def __init__(self, path: Path, after_data: Callable[[], None]) -> None:
        super().__init__(str(path))
        self.after_data = after_data

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        written = super().write_data(plan, planner)
        written.wait()
        self.after_data()
        return written


class Checkpointer:
    """Saves this rank's state every `every` completed steps under `root` (see the module docstring).

    Every rank constructs one at the same point (it creates a process group) and calls `save`, `poll`
    and `close` at the same steps. `during_save(step)` runs inside each save after the data is written
    (faults.Faults.during_save). `blocked_s`: how long the last save held up the step.
    """

    def __init__(self, root: Path, every: int, *, rank: int, world_size: int, plan_digest: str,
                 keep: int = DEFAULT_KEEP, synchronous: bool = False, timeout_s: float = 60.0,
                 during_save: Callable[[int], None] = lambda step: None) -> None:
        if every < 1:
            raise CheckpointError(f"a checkpoint every {every} steps", field="--checkpoint-every",
                                  fix="pass a positive number of steps (or leave it out: no checkpoints)")
        if keep < 1:
            raise CheckpointError(f"keeping {keep} checkpoints would delete the one just written",
                                  field="--keep-checkpoints", fix="pass 1 or more")
        self.root, self.every, self.keep, self.synchronous = root, every, keep, synchronous
        self.rank, self.world_size, self.plan_digest = rank, world_size, plan_digest
        self.during_save = during_save
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._pending: tuple[int, Future[Any]] | None = None
        self._marking = threading.Lock()
        self._marked: set[int] = set()
        self.blocked_s = 0.0

    def due(self, steps_done: int) -> bool:
        """Whether a checkpoint is taken after `steps_done` completed steps."""
        return steps_done > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, state: dict[str, Any]) -> None:
        """Write `state` (flat: name -> tensor or plain value) as the checkpoint of `steps_done` steps:
        staged here and written in the background, or written here under `synchronous`."""
        self.wait()                                 # one save in flight at a time
        folder = step_folder(self.root, steps_done)
        if self.rank == 0:                          # a folder of that step from an earlier attempt counts no more
            for stale in (folder / COMPLETE_FILE, folder / METADATA_FILE):
                stale.unlink(missing_ok=True)
        writer = _Writer(folder, lambda: self.during_save(steps_done))
        start = time.perf_counter()
        try:
            if self.synchronous:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            else:
                response = dcp.async_save(state, storage_writer=writer, process_group=self.group)
                future = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
                self._pending = (steps_done, future)
                # marked as soon as it is written (rank 0's save ends after every rank's data and the
                # metadata), not at the next poll: a rank dying in the step after it must not lose it
                future.add_done_callback(functools.partial(self._completed_if_written, steps_done=steps_done))
        except CheckpointException as exc:           # DCP's own error is a BaseException
            raise self._failed(steps_done, exc) from None
        self.blocked_s = time.perf_counter() - start
        if self.synchronous:
            self._completed(steps_done)

    def poll(self) -> None:
        """Finish the save in flight if its write is done (rank 0 marks it complete); never waits."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, then finish it (rank 0 marks it complete and prunes)."""
        if self._pending is None:
            return
        steps_done, future = self._pending
        self._pending = None
        try:
            future.result()
        except (CheckpointException, RuntimeError) as exc:
            raise self._failed(steps_done, exc) from None
        self._completed(steps_done)

    def close(self) -> None:
        """The end of the run: wait for the last save."""
        self.wait()

    def _completed_if_written(self, done: Future[Any], steps_done: int) -> None:
        """The background save's end (DCP's thread): mark it complete unless it failed (`wait` reports that)."""
        if not done.cancelled() and done.exception() is None:
            self._completed(steps_done)

    def _completed(self, steps_done: int) -> None:
        """Rank 0 marks the checkpoint of `steps_done` complete and prunes, once (from the save's own end
        or from `wait`, whichever comes first)."""
        if self.rank != 0:
            return
        with self._marking:
            if steps_done in self._marked:
                return
            write_marker(step_folder(self.root, steps_done), steps_done, self.plan_digest, self.world_size)
            prune(self.root, self.keep)
            self._marked.add(steps_done)

    def _failed(self, steps_done: int, exc: BaseException) -> CheckpointError:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return CheckpointError(f"saving the checkpoint of step {steps_done} failed: {first[:300]}",
                               file=str(step_folder(self.root, steps_done)),
                               fix="see the other ranks' lines; the previous complete checkpoint is intact")


def resume_folder(root: Path, *, resume: bool, resume_from: Path | None, restart_count: int) -> Path | None:
    """The checkpoint a run starts from: `--resume-from`'s (`resolve`), `--resume`'s latest complete one
    under `root` (none: CheckpointError), after a restart by torchrun (`restart_count` > 0) the latest
    complete one if any; else None (step 0)."""
    if resume_from is not None:
        return resolve(resume_from)
    latest = latest_complete(root)
    if resume and latest is None:
        raise CheckpointError("--resume: no complete checkpoint here", file=str(root),
                              fix="start without --resume, or pass --checkpoint-dir the folder holding step_<N>")
    return latest if resume or restart_count > 0 else None
