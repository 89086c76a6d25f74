"""Checkpoints of the emitted program: where they lie, when one counts, and which one a run resumes
from. Saving them with torch.distributed.checkpoint (DCP) is checkpoint_save.py.

Layout: `<root>/step_<N>/` holds the state after N completed steps (N is the next step to run): DCP's
per-rank data files, its `.metadata` (written last, by rank 0, once every rank's data is written) and
then `COMPLETE`, a JSON marker (step, plan digest, world size, time) that rank 0 writes through a
temporary sibling and `os.replace` after its save finished. Only a folder with both counts
(`is_complete`): a crash during a save leaves a folder without them, and the previous one stays the
latest (`latest_complete`). After a new one completes, rank 0 deletes the complete ones older than
the newest `keep` (`prune`); incomplete folders are left for a person to look at.

Nothing here imports DCP: a run that neither saves nor resumes never loads it (with ZeRO's optimizer
and FSDP's loss scaler, also imported on first use, 0.2-0.3 s of each rank's start-up on a CPU core).
What the state holds, and loading it into a rank of any plan of the model, is checkpoint_state.py.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

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


def is_step_folder(folder: Path) -> bool:
    """Whether `folder` is named as a checkpoint of one step (`step_<N>`), complete or not."""
    return _STEP_FOLDER.match(folder.name) is not None


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
