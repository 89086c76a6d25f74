"""`plan`: the command line. Typed options at the edge; domain errors become one line + exit code.

    plan MODEL.py --cluster SPEC.yaml [-o OUT]     trace, cost, solve, verify, emit
    plan inspect OUT                               summary of a plan
    plan run OUT [--steps N --seed S --lr X]       run the emitted program locally (torchrun)
    plan profile [--out FILE] [--model M] [--quick]  measure this machine; `plan --calibration FILE` uses it
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from planner import schedule
from planner.errors import HetplanError, PlanFileError

SUBCOMMANDS = ("inspect", "run", "profile")


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan", description="Plan training of MODEL on a heterogeneous cluster "
                                "and emit a torch.distributed program. Subcommands: inspect OUT, run OUT.")
    p.add_argument("model", help="model file defining model() and batch(batch_size, step)")
    p.add_argument("--cluster", required=True, help="cluster spec (YAML)")
    p.add_argument("-o", "--out", default="out", help="output directory (replaced atomically)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--strategy", default="ilp")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--stages", type=int, default=None, help="force every pipeline to this many stages")
    p.add_argument("--micro-batch", type=int, default=None, help="force the micro-batch size")
    p.add_argument("--use-all-devices", action="store_true", help="every device must serve a stage")
    p.add_argument("--schedule", default="auto", choices=schedule.CHOICES,
                   help="pipeline schedule: auto (the search chooses per replica), or force one")
    p.add_argument("--compression", default="none",
                   choices=["none", "auto", "fp16", "bf16", "powersgd", "onebit"],
                   help="gradient compression: none (exact), auto (the planner picks what pays per group), "
                        "or force one method on every gradient group it applies to")
    p.add_argument("--activation-compression", default="none",
                   choices=["none", "auto", "fp16", "bf16", "int8"],
                   help="compression of activations and their gradients on pipeline links")
    p.add_argument("--memory-margin", type=float, default=0.1, help="fraction of device memory kept free")
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="solver work limit in CP-SAT deterministic seconds (reproducible, unlike wall time); "
                        "the best plan found, its bound and gap are reported")
    p.add_argument("--lr", type=float, default=1e-3, help="default learning rate of the emitted program")
    p.add_argument("--model-fn", default="model")
    p.add_argument("--batch-fn", default="batch")
    p.add_argument("--loss-fn", default="loss_fn")
    p.add_argument("--dump-ir", action="store_true", help="write the graph after each pass to OUT/ir/")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration file from `plan profile`: measured figures replace the datasheet's")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="the emitted program's default optimizer (1-bit compression under AdamW is 1-bit Adam, "
                        "whose exact warm-up `--compression auto` accounts for)")
    p.add_argument("--objective", default="time", choices=["time", "cost"],
                   help="minimise time per iteration, or cost per sample (needs price_per_hour in the spec)")
    p.add_argument("--no-runners-up", action="store_true",
                   help="skip planning and simulating the baselines and the other topology regime "
                        "(`plan inspect` then cannot say why this plan won)")
    return p


def _write_atomically(out: Path, fill) -> None:
    """Build the output in a temporary sibling directory, then swap it in."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cmd_plan(argv: list[str]) -> int:
    from backends.report.terminal import summary
    from backends.torchdist.emit import emit_program
    from planner.api import PlanOptions, plan

    args = _plan_parser().parse_args(argv)
    names = {"model": args.model_fn, "batch": args.batch_fn, "loss_fn": args.loss_fn}
    options = PlanOptions(global_batch=args.global_batch, strategy=args.strategy, precision=args.precision,
                          stages=args.stages, memory_margin=args.memory_margin, schedule=args.schedule,
                          time_limit_s=args.time_limit, use_all_devices=args.use_all_devices,
                          micro_batch=args.micro_batch, compression=args.compression,
                          activation_compression=args.activation_compression,
                          calibration=args.calibration, runners_up=not args.no_runners_up,
                          objective=args.objective, optimizer=args.optimizer,
                          names={k: v for k, v in names.items() if v != k})
    result = plan(args.model, args.cluster, options)
    text = summary(result.plan)

    def fill(tmp: Path) -> None:
        result.plan.save(tmp / "plan.json")
        (tmp / "summary.txt").write_text(text)
        (tmp / "solve.json").write_text(_timings_json(result.timings_s))
        emit_program(result.plan, Path(args.model), tmp / "program", names=options.names, lr=args.lr,
                     optimizer=args.optimizer)

    _write_atomically(Path(args.out), fill)
    print(text + f"\nwrote {args.out}/plan.json and {args.out}/program/ (run: plan run {args.out})")
    return 0


def _timings_json(timings: dict[str, float]) -> str:
    import json

    return json.dumps({k: round(v, 6) for k, v in timings.items()}, indent=1, sort_keys=True) + "\n"


def cmd_inspect(argv: list[str]) -> int:
    from backends.report.terminal import memory_table, runners_up_section, simulation_section, summary
    from planner.ir import Plan
    from planner.spec import load_cluster

    p = argparse.ArgumentParser(prog="plan inspect", description="Show a plan.")
    p.add_argument("out", help="plan directory (or plan.json)")
    p.add_argument("--cluster", default=None, help="cluster spec for the simulated Gantt chart "
                   "(default: the one the plan was made for, if it is still there)")
    args = p.parse_args(argv)
    plan = Plan.load(args.out)
    print(summary(plan))
    print(runners_up_section(plan) + "\n")
    print(memory_table(plan) + "\n")
    spec_path = args.cluster or plan.inputs.cluster_path
    if spec_path and Path(spec_path).is_file():
        print(simulation_section(plan, load_cluster(spec_path)))
    else:
        print(f"(no simulation: cluster spec {spec_path or '?'} not found; pass --cluster)")
    return 0


def cmd_run(argv: list[str]) -> int:
    from planner.ir import Plan

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in SUBCOMMANDS:
            from planner.profile_cmd import cmd_profile

            return {"inspect": cmd_inspect, "run": cmd_run, "profile": cmd_profile}[argv[0]](argv[1:])
        return cmd_plan(argv)
    except HetplanError as exc:
        print(f"plan: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
