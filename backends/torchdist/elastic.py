"""`plan run --elastic`: continue on the devices that are left when one stays lost.

torchrun stays the launcher and restarts the group itself (`--max-restarts`); each restart resumes from
the last complete checkpoint (program/checkpoint.py). When a launch still fails, its log says which rank
failed in each attempt (local_run.attempt_failures). A device whose rank failed in the last attempt and
again in the one before it — it failed after restarting on the same device — is lost: the supervisor
re-plans the same model, global batch and options without it (planner's `replan`), and starts the new
plan's program from the last complete checkpoint of the old one (DCP loads it by name, resharded to the
new stages). It writes what it did, one JSON line per decision, to `<out>/run/elastic.jsonl`, and says it
on stdout. The new plans live in `<out>/elastic/<k>/` (a plan folder each, with its own run/).

A failure that is not a lost device (a rank that failed once, then its restart failed on another rank;
a bad input; no checkpoint yet) ends the run as without --elastic, with its one line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from planner.core.ir import Plan

from .local_run import RunOutcome
from .program import checkpoint
from .program.faults import Fault
from .run_failures import attempt_failures, launcher_text

ELASTIC_LOG = "elastic.jsonl"
ELASTIC_DIR = "elastic"


@dataclass(frozen=True)
class Launch:
    """One plan to run: its folder (plan.json, program/) and the run folder its program writes."""

    plan: Plan
    plan_dir: Path
    run_dir: Path


def lost_device(devices: Sequence[str], launcher: str) -> str | None:
    """The device (of `devices`, the plan's per rank) of the rank that failed in the last two attempts of
    a launch (its log `launcher`), or None: a device is lost when its rank fails again after a restart."""
    failed = attempt_failures(launcher)
    if len(failed) < 2 or failed[-1][0] != failed[-2][0] or not 0 <= failed[-1][0] < len(devices):
        return None
    return devices[failed[-1][0]]


def run_elastic(first: Launch, train_args: Sequence[str], faults: Sequence[Fault], *,
                run: Callable[[Launch, list[str]], RunOutcome],
                replan: Callable[[Path, Sequence[str], Path], Plan], checkpoint_root: Callable[[Launch], Path],
                stream: TextIO) -> RunOutcome:
    """Run `first`, and while a launch ends with a lost device, re-plan without it and run on from the last
    complete checkpoint. `run(launch, args)` launches one plan's program (args: `train_args`, the faults
    that name a device of that plan, and where to resume from); `replan(plan_dir, without, new_dir)`
    writes a plan folder; `checkpoint_root(launch)` is where that launch's program saves."""
    launch = first
    lost: list[str] = []
    extra: list[str] = []
    log = first.run_dir / ELASTIC_LOG
    while True:
        mine = [f"--fault={f}" for f in faults if f.device in launch.plan.devices]
        outcome = run(launch, [*train_args, *mine, *extra])
        if outcome.returncode == 0:
            return outcome
        device = lost_device(launch.plan.devices, launcher_text(launch.run_dir))
        resume = checkpoint.latest_complete(checkpoint_root(launch))
        if device is None or resume is None:
            return outcome
        if len(launch.plan.devices) == 1:
            return RunOutcome(outcome.returncode, f"{outcome.message}; {device}, the plan's last device, is lost")
        lost.append(device)
        new_dir = first.plan_dir / ELASTIC_DIR / str(len(lost))
        _say(stream, log, event="device_lost", device=device, plan=str(launch.plan_dir),
             text=f"plan run --elastic: {device} failed again after a restart: lost; re-planning without "
                  f"{', '.join(lost)}")
        new_plan = replan(launch.plan_dir, [device], new_dir)
        launch = Launch(new_plan, new_dir, new_dir / "run")
        step = checkpoint.step_of(resume)
        _say(stream, log, event="replanned", without=list(lost), plan=str(new_dir), resume_from=str(resume),
             step=step, world_size=new_plan.world_size,
             text=f"plan run --elastic: {new_dir} replaces it ({new_plan.world_size} ranks on "
                  f"{', '.join(sorted(set(new_plan.devices)))}); resuming from step {step} ({resume})")
        train_args = [a for a in train_args if a != "--resume"]     # the new plan's run starts from `resume`
        extra = ["--resume-from", str(resume)]


def _say(stream: TextIO, log: Path, *, text: str, **fields: object) -> None:
    """One line on `stream` and one JSON record in `log` (appended)."""
    print(text, file=stream, flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), **fields, "message": text}, sort_keys=True) + "\n")
