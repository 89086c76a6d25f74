"""`plan MODEL.py --cluster SPEC.yaml -o OUT`: trace, cost, solve, verify, emit."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from planner.cli.output_dir import write_atomically
from planner.core import schedule
from planner.core.ir import ProgramDefaults


def plan_parser() -> argparse.ArgumentParser:
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


def cmd_plan(argv: list[str]) -> int:
    args = plan_parser().parse_args(argv)
    # the planner is imported once the arguments are known good: `plan --help` needs no torch
    from backends.report.terminal import summary
    from backends.torchdist.emit import emit_program
    from planner.api import PlanOptions, plan

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
    planned = dataclasses.replace(result.plan, program=ProgramDefaults(
        learning_rate=args.lr, optimizer=args.optimizer, functions=tuple(sorted(options.names.items()))))
    text = summary(planned)

    def fill(tmp: Path) -> None:
        planned.save(tmp / "plan.json")
        (tmp / "summary.txt").write_text(text)
        (tmp / "solve.json").write_text(_timings_json(result.timings_s))
        emit_program(planned, Path(args.model), tmp / "program", names=options.names, lr=args.lr,
                     optimizer=args.optimizer)

    write_atomically(Path(args.out), fill)
    print(text + f"\nwrote {args.out}/plan.json and {args.out}/program/ (run: plan run {args.out})")
    return 0


def _timings_json(timings: dict[str, float]) -> str:
    return json.dumps({k: round(v, 6) for k, v in timings.items()}, indent=1, sort_keys=True) + "\n"
