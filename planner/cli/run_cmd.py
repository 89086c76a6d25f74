"""`plan run OUT`: run the emitted program on this machine (torchrun, gloo on CPU)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from planner.core.errors import PlanFileError
from planner.core.ir import Plan


def cmd_run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="plan run", description="Run the emitted program on this machine.")
    p.add_argument("out", help="plan directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default=None)
    p.add_argument("--save-final", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    program = out / "program" / "train.py"
    if not program.is_file():
        raise PlanFileError("no emitted program", file=str(program), fix=f"run `plan MODEL --cluster SPEC -o {out}`")
    plan = Plan.load(out / "program" / "plan.json")
    run_dir = out / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(plan.world_size), str(program), "--steps", str(args.steps), "--seed", str(args.seed),
           "--out", str(run_dir)]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    if args.optimizer:
        cmd += ["--optimizer", args.optimizer]
    if args.save_final:
        cmd.append("--save-final")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)
