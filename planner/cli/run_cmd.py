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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cli.plan_files import load_checked_plan
from planner.core.arguments import OneLineParser, positive_number
from planner.core.errors import OptionError, PlanFileError
from planner.core.ir import Plan

if TYPE_CHECKING:
    from planner.frontend.model_file import ModelFile

DEFAULT_TIMEOUT_S = 60.0
# options that count devices: a plan on fewer devices may have to drop them (--elastic says so)
RELAXED_ON_REPLAN = ("--stages", "--use-all-devices")


def run_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan run", description="Run the emitted program on this machine.")
    p.add_argument("out", help="plan directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=positive_number("--lr"), default=None,
                   help="learning rate (default: the plan's)")
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
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="save an asynchronous checkpoint (torch.distributed.checkpoint) every STEPS steps "
                        "under OUT/run/ckpt/")
    p.add_argument("--sync-checkpoint", action="store_true",
                   help="write each checkpoint within the step (default: stage a copy, write it in the background)")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="K",
                   help="keep the last K complete checkpoints (default: the program's, 3)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in OUT/run from its last complete checkpoint")
    p.add_argument("--resume-from", default=None, metavar="CKPT",
                   help="start from a checkpoint folder, possibly of another plan of the same model "
                        "(e.g. the plan `plan replan` replaced): loaded by name, resharded to this plan")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole group up to N times after a worker fails (torchrun); each "
                        "restart resumes from the last complete checkpoint")
    p.add_argument("--elastic", action="store_true",
                   help="when a device's worker fails again after a restart, re-plan without that device "
                        "and continue from the last complete checkpoint (needs --checkpoint-every and "
                        "--max-restarts 1 or more)")
    p.add_argument("--rebalance", action="store_true",
                   help="re-solve the replicas' batch shares while training when their measured speeds "
                        "drift from the plan's")
    p.add_argument("--fault", action="append", default=[], metavar="FAULT",
                   help="inject a fault to test recovery: kill:DEVICE@STEP, kill-always:DEVICE@STEP, "
                        "crash-in-save:DEVICE@STEP or slow:DEVICE=FACTOR@STEP (repeatable)")
    return p


def program_model_file(plan: Plan, program: Path) -> ModelFile:
    """The program's copy of the model file, loaded under the contract names the plan was made with."""
    from planner import frontend

    return frontend.load_model_file(program / "model.py", dict(plan.program.functions) if plan.program else {})


def check_data(plan: Plan, program: Path, data: str) -> None:
    """`--data PATH` is there and the model file has a dataset() to read it, or one line before any rank
    starts (a model file of batch() alone would train on its rows and never read PATH)."""
    if not Path(data).exists():
        raise OptionError(f"{data}: no such file or folder", field="--data",
                          fix="pass the data file or folder the model file's dataset() reads")
    model_file = program_model_file(plan, program)
    if model_file.dataset is None:
        name = dict(plan.program.functions).get("dataset", "dataset") if plan.program else "dataset"
        raise OptionError(f"the model file defines no {name}() to read {data}: every step's rows would come "
                          "from its batch()", field="--data",
                          fix=f"define {name}() in the model file (it finds the path in $HETPLAN_DATA), or drop "
                              "--data")


def check_weights_file(plan: Plan, program: Path, path: Path) -> None:
    """Every tensor of the model is in the weights at its shape (headers only), or one line before any rank
    starts (WeightsError)."""
    from backends.torchdist.program import materialise, weights

    meta = materialise.build_meta(program_model_file(plan, program), seed=0)
    weights.check_weights(path, weights.model_tensors(meta.module), weights.tied_aliases(meta.module))


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise OptionError(f"{args.timeout} is not a positive number of seconds", field="--timeout",
                           fix="pass e.g. --timeout 60")
    if args.steps < 1:   # 0 would start every rank and train nothing (--dry-run builds them without training)
        raise OptionError(f"{args.steps} is not a number of steps to train", field="--steps",
                           fix="pass --steps 1 or more (--dry-run builds every rank without training)")
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
    faults = _check_recovery_options(args, plan, run_dir)
    from backends.torchdist.program.rebalance import check_schedule

    check_schedule(plan, args.rebalance)
    if args.data is not None:
        check_data(plan, program, args.data)
    if args.weights is not None:
        check_weights_file(plan, program, Path(args.weights))
    if not args.resume:
        kept = keep_previous_run(run_dir)
        if kept is not None:
            print(f"plan run: the previous run is kept in {kept}", flush=True)
            # a checkpoint of that run (`--weights out/run/ckpt`) is read where it went
            args.weights = _moved(args.weights, run_dir, kept)
            args.resume_from = _moved(args.resume_from, run_dir, kept)
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
        train_args += ["--weights", str(Path(args.weights).resolve())]
    train_args += _recovery_args(args)
    if args.elastic:
        outcome = _run_elastic(args, plan, out, train_args, faults)
    else:
        train_args += [f"--fault={f}" for f in faults]
        with Progress("plan run") as progress:    # on a terminal only: the start-up, until the first step
            outcome = run_program(plan, program, run_dir, train_args, timeout_s=args.timeout, progress=progress,
                                  emulate_memory=args.emulate_memory, report=sys.stdout, steps=args.steps,
                                  max_restarts=args.max_restarts)
    if outcome.message:
        print(outcome.message, file=sys.stderr, flush=True)
    return outcome.returncode



def _check_recovery_options(args: argparse.Namespace, plan: Plan, run_dir: Path) -> list:
    """The checkpoint, restart and fault options make sense together (OptionError otherwise); the faults."""
    from backends.torchdist.program import checkpoint, faults

    for name in ("checkpoint_every", "max_restarts"):
        if getattr(args, name) < 0:
            flag = "--" + name.replace("_", "-")
            raise OptionError(f"{getattr(args, name)} is below 0", field=flag, fix=f"pass {flag} 0 or more")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        raise OptionError(f"{args.keep_checkpoints} keeps no checkpoint", field="--keep-checkpoints",
                          fix="pass --keep-checkpoints 1 or more")
    if args.resume and args.resume_from:
        raise OptionError("--resume continues this run, --resume-from starts from another checkpoint",
                          field="--resume", fix="pass one of them")
    if args.resume and checkpoint.latest_complete(run_dir / checkpoint.CHECKPOINT_DIR) is None:
        raise OptionError(f"no complete checkpoint in {run_dir / checkpoint.CHECKPOINT_DIR}", field="--resume",
                          fix="run with --checkpoint-every N first, or pass --resume-from CKPT")
    if args.resume_from is not None:
        checkpoint.resolve(Path(args.resume_from))        # a complete checkpoint, or one line
    if args.elastic and not (args.checkpoint_every > 0 and args.max_restarts > 0):
        raise OptionError("--elastic continues from checkpoints after a device fails again on restart",
                          field="--elastic", fix="add --checkpoint-every N and --max-restarts 1 (or more)")
    if args.max_restarts > 0 and args.checkpoint_every == 0:
        print("plan run: --max-restarts without --checkpoint-every: a restart begins again at step 0",
              file=sys.stderr, flush=True)
    found = [faults.parse(text) for text in args.fault]
    faults.check_devices(found, plan.devices)
    return found


def _moved(path: str | Path | None, run_dir: Path, kept: Path) -> Path | None:
    """`path` after the run folder `run_dir` moved to `kept`: the same place inside `kept` if it was inside."""
    if path is None:
        return None
    try:
        return kept.resolve() / Path(path).resolve().relative_to(run_dir.resolve())
    except ValueError:
        return Path(path)


def _recovery_args(args: argparse.Namespace) -> list[str]:
    """train.py's flags for checkpoints, resuming and rebalancing."""
    out = []
    if args.checkpoint_every:
        out += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.keep_checkpoints is not None:
        out += ["--keep-checkpoints", str(args.keep_checkpoints)]
    if args.sync_checkpoint:
        out.append("--sync-checkpoint")
    if args.resume:
        out.append("--resume")
    if args.resume_from is not None:
        out += ["--resume-from", str(Path(args.resume_from).resolve())]
    if args.rebalance:
        out.append("--rebalance")
    return out


def _run_elastic(args: argparse.Namespace, plan: Plan, out: Path, train_args: list[str], faults: list):
    """--elastic: run, and re-plan without a device that stays lost (backends.torchdist.elastic)."""
    from backends.report.progress import Progress
    from backends.torchdist.elastic import Launch, run_elastic
    from backends.torchdist.local_run import run_program
    from backends.torchdist.program import checkpoint
    from planner.cli.replan_cmd import replan

    def run(launch: Launch, launch_args: list[str]):
        with Progress("plan run") as progress:
            return run_program(launch.plan, launch.plan_dir / "program", launch.run_dir, launch_args,
                               timeout_s=args.timeout, progress=progress, emulate_memory=args.emulate_memory,
                               report=sys.stdout, steps=args.steps, max_restarts=args.max_restarts)

    def replan_around(plan_dir: Path, without: Sequence[str], new_dir: Path) -> Plan:
        """The same options where they still fit the devices left; else the device-counting ones relaxed."""
        try:
            return replan(plan_dir, without, new_dir, echo=True)
        except OptionError as exc:
            if exc.field not in RELAXED_ON_REPLAN:
                raise
            print(f"plan run --elastic: {exc.message}: re-planning without {', '.join(RELAXED_ON_REPLAN)}",
                  flush=True)
            return replan(plan_dir, without, new_dir, echo=True,
                          overrides={"stages": None, "tp": None, "use_all_devices": False})

    return run_elastic(Launch(plan, out, out / "run"), train_args, faults, run=run, replan=replan_around,
                       checkpoint_root=lambda launch: launch.run_dir / checkpoint.CHECKPOINT_DIR, stream=sys.stdout)
