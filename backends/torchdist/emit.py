"""Emit `out/program/`: the program package copied verbatim, the plan, the model file, the launcher.

The program (backends/torchdist/program/) is ordinary, linted, tested code: every unit is copied as it
is, and all it knows of a plan it reads from `plan.json` at run time. Nothing from a spec, a model name
or a plan is formatted into Python; `launch.sh` gets numbers and checked names only (launch_script).
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

from planner.core.ir import Plan

from .launch_script import launch_script

PROGRAM_SOURCE = Path(__file__).resolve().parent / "program"
RESERVED = ("model.py", "plan.json", "launch.sh")   # what emit_program writes beside the units


def program_units() -> list[Path]:
    """The program's source files, copied into every emitted program."""
    units = sorted(PROGRAM_SOURCE.glob("*.py"))
    clash = [p.name for p in units if p.name in RESERVED]
    if clash:
        raise RuntimeError(f"program unit named like an emitted file: {clash}")
    return units


def emit_program(plan: Plan, model_path: Path, program_dir: Path) -> None:
    """Write the program's units, plan.json, a copy of the model file and launch.sh into `program_dir`."""
    program_dir.mkdir(parents=True, exist_ok=True)
    for unit in program_units():
        shutil.copyfile(unit, program_dir / unit.name)
    plan.save(program_dir / "plan.json")
    shutil.copyfile(model_path, program_dir / "model.py")
    launch = program_dir / "launch.sh"
    launch.write_text(launch_script(plan))
    launch.chmod(launch.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
