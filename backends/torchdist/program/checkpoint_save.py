"""Saving the emitted program's checkpoints with torch.distributed.checkpoint (DCP), asynchronously by
default, into the layout checkpoint.py describes.

`Checkpointer.save` stages a CPU copy of the state (the only part that blocks the step) and writes it
in a background thread (`dcp.async_save`), over a gloo group of its own so that the training's
collectives on the default group never interleave with DCP's; `--sync-checkpoint` writes in the step
instead. At most one save is in flight: the next one, and the end of the run, wait for it. Rank 0 marks
a save complete once every rank's data and DCP's metadata are written, then prunes (checkpoint.py).
train.py imports this unit only under --checkpoint-every.
"""

from __future__ import annotations

import datetime
import functools
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

from .checkpoint import COMPLETE_FILE, DEFAULT_KEEP, METADATA_FILE, CheckpointError, prune, step_folder, write_marker


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
