"""`plan run OUT`: run the emitted program on this machine (torchrun, gloo on CPU), on loopback only.

The plan is checked as `plan` checked it before it runs (plan_files.load_checked_plan); an earlier run
folder is kept (`OUT/runs/<n>`); SIGTERM / SIGINT stop torchrun and every worker; a rank's death ends
the run with one line. While it trains, a plain line per step (at most one every few seconds) on stdout;
at its end each rank's peak memory beside the plan's estimate, and where the metrics and logs are.
How: backends.torchdist.local_run.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from planner.cli.args import OneLineParser
from planner.cli.plan_files import load_checked_plan
from planner.core.errors import OptionError, PlanFileError
from planner.core.ir import Plan

DEFAULT_TIMEOUT_S = 60.0


def run_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan run", description="Run the emitted program on this machine.")
    p.add_argument("out", help="plan directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the plan's)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default=None, help="default: the plan's")
    p.add_argument("--save-final", action="store_true", help="write each rank's parameters to OUT/run/final/")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a rank may wait for a peer (a collective or a receive) before the run fails")
    p.add_argument("--allow-changed", action="store_true",
                   help="run a plan whose model file or spec changed since it was planned")
    p.add_argument("--weights", default=None,
                   help="start from pretrained weights: a .safetensors file, a Hugging Face model folder or a "
                        "torch.distributed.checkpoint folder (checked against the model before any rank starts)")
    p.add_argument("--data", default=None, help="the data file or folder the model file's dataset() reads")
    p.add_argument("--dry-run", action="store_true",
                   help="build every rank's stage on meta as the program would (shapes, memory, start-up), "
                        "run nothing; writes OUT/dry_run.json")
    p.add_argument("--emulate-memory", action="store_true",
                   help="hold each CPU rank to its device's memory from the spec (RLIMIT_DATA), so a rank "
                        "that outgrows it fails as the device would")
    return p


def check_weights_file(plan: Plan, program: Path, path: Path) -> None:
    """Every tensor of the model is in the weights at its shape (headers only), or one line before any rank
    starts (WeightsError)."""
    from backends.torchdist.program import materialise, weights
    from planner import frontend

    functions = dict(plan.program.functions) if plan.program else {}
    meta = materialise.build_meta(frontend.load_model_file(program / "model.py", functions), seed=0)
    weights.check_weights(path, weights.model_tensors(meta.module), weights.tied_aliases(meta.module))


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise OptionError(f"{args.timeout} is not a positive number of seconds", field="--timeout",
                           fix="pass e.g. --timeout 60")
    if args.steps < 0:
        raise OptionError(f"{args.steps} is not a number of steps", field="--steps",
                           fix="pass --steps 1 or more")
    out = Path(args.out)
    program = out / "program"
    if not (program / "train.py").is_file():
        raise PlanFileError("no emitted program", file=str(program / "train.py"),
                            fix=f"run `plan MODEL --cluster SPEC -o {out}`")
    plan = load_checked_plan(program / "plan.json", allow_changed=args.allow_changed)
    # torch is imported once the plan is known good
    from backends.report.progress import Progress
    from backends.torchdist.local_run import keep_previous_run, run_program

    if args.dry_run:
        from backends.torchdist.local_dry_run import dry_run, table

        with Progress("plan run --dry-run"):
            records = dry_run(plan, program, out, seed=args.seed)
        print(table(plan, records))
        print(f"plan run: the records of every rank are in {out / 'dry_run.json'}")
        return 0
    run_dir = out / "run"
    kept = keep_previous_run(run_dir)
    if kept is not None:
        print(f"plan run: the previous run is kept in {kept}", flush=True)
    train_args = ["--steps", str(args.steps), "--seed", str(args.seed)]
    if args.lr is not None:
        train_args += ["--lr", repr(args.lr)]
    if args.optimizer:
        train_args += ["--optimizer", args.optimizer]
    if args.save_final:
        train_args.append("--save-final")
    if args.data is not None:
        train_args += ["--data", str(Path(args.data).resolve())]
    if args.weights is not None:
        check_weights_file(plan, program, Path(args.weights))
        train_args += ["--weights", str(Path(args.weights).resolve())]
    with Progress("plan run") as progress:    # on a terminal only: the start-up, until the first step
        outcome = run_program(plan, program, run_dir, train_args, timeout_s=args.timeout, progress=progress,
                              emulate_memory=args.emulate_memory, report=sys.stdout, steps=args.steps)
    if outcome.message:
        print(outcome.message, file=sys.stderr, flush=True)
    return outcome.returncode

