"""`plan MODEL.py --cluster SPEC.yaml -o OUT`: trace, cost, solve, verify, emit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cli.output_dir import MARKER, check_output_dir, write_atomically, written_as_it_goes, wrote_line
from planner.core import interrupts, schedule
from planner.core.arguments import OneLineParser, positive_number
from planner.core.errors import HetplanError, printable
from planner.core.ir import Plan, ProgramDefaults

if TYPE_CHECKING:
    from backends.report.progress import Progress
    from planner.api import PlanResult


def plan_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan", description="Plan training of MODEL on a heterogeneous cluster "
                      "and emit a torch.distributed program. Subcommands: inspect OUT, diff A B, run OUT, "
                      "replan OUT, export OUT, profile.")
    p.add_argument("model", help="model file defining model() and batch(batch_size, step), or an .onnx graph "
                                 "(cost-only: planned, no program emitted)")
    p.add_argument("--cluster", required=True, help="cluster spec (YAML)")
    p.add_argument("-o", "--out", default="out",
                   help=f"output directory: a new or empty one, or a previous plan's (it holds {MARKER}), "
                        "replaced atomically; never the current directory or one holding the inputs")
    p.add_argument("--force", action="store_true",
                   help="replace OUT (and a dump DIR) even if it is a non-empty directory hetplan did not write")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--strategy", default="ilp",
                   help="ilp (the planner), exact (enumerates the same space, small clusters), or a baseline: "
                        "uniform, fastest, megatron, metis, single (the best one-device plan), dp (the best "
                        "pure data-parallel plan)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--stages", type=int, default=None,
                   help="force every pipeline to this many stages (interleaved 1F1B: over stages / 2 or / 4 devices)")
    p.add_argument("--tp", type=int, default=None,
                   help="force the tensor-parallel degree of every stage: 1, 2, 4 or 8 devices of a node "
                        "(default: searched)")
    p.add_argument("--zero", default="auto", choices=["auto", "on", "off"],
                   help="shard the optimizer state across replicas (ZeRO-1): auto where memory is short, "
                        "on for every gradient group, off")
    p.add_argument("--micro-batch", type=int, default=None, help="force the micro-batch size")
    p.add_argument("--use-all-devices", action="store_true", help="every device must serve a stage")
    p.add_argument("--schedule", default="auto", choices=schedule.CHOICES,
                   help="pipeline schedule: auto (the search chooses per replica among 1f1b, gpipe and "
                        "interleaved), or force one (zbh1: zero bubble, weight gradients fill the drain)")
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
    p.add_argument("--lr", type=positive_number("--lr"), default=1e-3,
                   help="default learning rate of the emitted program")
    p.add_argument("--trace-timeout", type=positive_number("--trace-timeout"), default=None, metavar="SECONDS",
                   help="stop the model file's code (import, model(), batch(), loss, tracing) after this long "
                        "(default: 300, planner.options.DEFAULT_TRACE_TIMEOUT_S)")
    p.add_argument("--model-fn", default="model")
    p.add_argument("--batch-fn", default="batch")
    p.add_argument("--loss-fn", default="loss_fn")
    p.add_argument("--dataset-fn", default="dataset")
    p.add_argument("--dump-ir", default=None, metavar="DIR",
                   help="write the graph after each pass (001_meta_shapes.txt, ...), the costed problem the "
                        "search reads (costed_problem.json) and its candidate configurations to DIR "
                        "(outside OUT, which is replaced whole); DIR is new, empty or an earlier dump (or "
                        "--force), replaced whole when planning ends, also when it fails, for a bug report")
    p.add_argument("--dump-cp-model", default=None, metavar="DIR",
                   help="write every CP-SAT model the search solves to DIR as <name>.pbtxt, for a bug report "
                        "(DIR as --dump-ir's)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration file from `plan profile`: measured figures replace the datasheet's")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="the emitted program's default optimizer (1-bit compression under AdamW is 1-bit Adam, "
                        "whose exact warm-up `--compression auto` accounts for)")
    p.add_argument("--objective", default="time", choices=["time", "cost"],
                   help="minimise time per iteration, or cost per sample (needs price_per_hour in the spec)")
    p.add_argument("--no-runners-up", action="store_true",
                   help="skip planning and simulating the baselines, the best single-device and data-parallel "
                        "plans and the other topology regime (`plan inspect` then cannot say why this plan won)")
    return p


def cmd_plan(argv: list[str]) -> int:
    args = plan_parser().parse_args(argv)
    inputs = [path for path in (args.model, args.cluster, args.calibration) if path]
    check_output_dir(Path(args.out), inputs=inputs, force=args.force)   # before planning, not after it
    dump_folders = _dump_folders(args)
    for folder, flag in dump_folders:
        check_output_dir(folder, inputs=inputs, force=args.force, option=flag)
    from backends.report.progress import Progress  # no torch: the status shows while torch is imported

    with Progress("plan") as progress:     # on a terminal only: the phase running now, on stderr
        progress.phase("start-up")
        return _plan(args, inputs, dump_folders, progress)


def _plan(args: argparse.Namespace, inputs: list[str], dump_folders: list[tuple[Path, str]],
          progress: Progress) -> int:
    # the planner is imported once the arguments are known good: `plan --help` needs no torch
    from planner.api import PlanOptions, RunControls, plan
    from planner.frontend.onnx_model import is_onnx_file

    names = {"model": args.model_fn, "batch": args.batch_fn, "loss_fn": args.loss_fn, "dataset": args.dataset_fn}
    options = PlanOptions(global_batch=args.global_batch, strategy=args.strategy, precision=args.precision,
                          stages=args.stages, tp=args.tp, zero=args.zero, memory_margin=args.memory_margin,
                          schedule=args.schedule,
                          time_limit_s=args.time_limit, use_all_devices=args.use_all_devices,
                          micro_batch=args.micro_batch, compression=args.compression,
                          activation_compression=args.activation_compression,
                          calibration=args.calibration, runners_up=not args.no_runners_up,
                          objective=args.objective, optimizer=args.optimizer,
                          names={k: v for k, v in names.items() if v != k})
    with ExitStack() as dumping:       # each dump folder takes its place when planning ends, failed or not
        written: dict[Path, Path] = {}      # each folder once, where both flags name it
        dumps: dict[str, Path] = {}
        for folder, flag in dump_folders:
            if folder.resolve() not in written:
                written[folder.resolve()] = dumping.enter_context(
                    written_as_it_goes(folder, inputs=inputs, force=args.force, option=flag))
            dumps[flag] = written[folder.resolve()]
        controls = RunControls(dump_ir_dir=dumps.get("--dump-ir"), dump_cp_model_dir=dumps.get("--dump-cp-model"),
                               progress=progress.phase if progress.enabled else None,
                               **({"trace_timeout_s": args.trace_timeout} if args.trace_timeout else {}))
        result = plan(args.model, args.cluster, options, controls)
    cost_only = is_onnx_file(args.model)   # an ONNX graph has no torch code to emit a program from
    planned = result.plan if cost_only else dataclasses.replace(result.plan, program=ProgramDefaults(
        learning_rate=args.lr, optimizer=args.optimizer, functions=tuple(sorted(options.names.items()))))
    progress.phase("write")
    shown = write_plan_dir(Path(args.out), planned, result, None if cost_only else Path(args.model),
                           inputs=inputs, force=args.force, note=f"\n{COST_ONLY_NOTE}\n" if cost_only else "")
    progress.close()     # the status line is gone before the summary prints
    for warning in planned.warnings:
        print(f"plan: warning: {printable(warning)}", file=sys.stderr)
    if cost_only:
        print(shown + "\n" + wrote_line(Path(args.out), program=False))
        return 0
    print(shown + "\n" + wrote_line(Path(args.out)))
    return 0


def write_plan_dir(out: Path, planned: Plan, result: PlanResult, model: Path | None, *,
                   inputs: Iterable[str | Path], force: bool, note: str = "") -> str:
    """Write the plan directory `out` of `planned` as `plan -o` does, whole or not at all: plan.json,
    summary.txt (every table whole, and the warnings), solve.json (the phases' times) and, from the model
    file `model` (None: a cost-only plan), the program. Returns the summary for the terminal (tables fit
    its width; warnings go to stderr); `note` ends both summaries."""
    from backends.report.terminal import summary
    from backends.torchdist.emit import emit_program

    tail = "\n" + _timings_text(result.timings_s, result.pass_timings_s) + note
    text = summary(planned, width=None) + tail

    def fill(tmp: Path) -> None:
        planned.save(tmp / "plan.json")
        (tmp / "summary.txt").write_text(text)
        (tmp / "solve.json").write_text(_timings_json(result.timings_s, result.pass_timings_s))
        if model is not None:
            emit_program(planned, model, tmp / "program")

    interrupts.check()      # a Ctrl-C whose exception the interpreter dropped ends the command here, before writing
    write_atomically(out, fill, inputs=inputs, force=force)
    return summary(planned, warnings=False) + tail


COST_ONLY_NOTE = ("cost-only plan from an ONNX graph: no program emitted; run `plan export` on a PyTorch plan "
                  "for ONNX stages")


def _dump_folders(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """The folders the dump flags name, each with its flag; refused inside OUT, which the run replaces whole.
    A dump folder is written under `-o`'s rule (planner.cli.output_dir.written_as_it_goes)."""
    folders = []
    out_dir = Path(args.out).resolve()
    for value, flag in ((args.dump_ir, "--dump-ir"), (args.dump_cp_model, "--dump-cp-model")):
        if value is None:
            continue
        folder = Path(value).resolve()
        if folder == out_dir or out_dir in folder.parents:
            raise HetplanError(f"{value} is inside the output directory {args.out}, which every run replaces whole",
                               field=flag, fix=f"dump to a folder beside it, e.g. {flag} {args.out.rstrip('/')}-dump")
        if folder in out_dir.parents:
            raise HetplanError(f"{value} holds the output directory {args.out}; a dump replaces its folder whole",
                               field=flag, fix=f"dump to a folder beside it, e.g. {flag} {args.out.rstrip('/')}-dump")
        folders.append((Path(value), flag))
    return folders


def _timings_json(phases_s: dict[str, float], passes_s: dict[str, float]) -> str:
    doc = {**{k: round(v, 6) for k, v in phases_s.items()}, "passes_s": {k: round(v, 6) for k, v in passes_s.items()}}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def _timings_text(phases_s: dict[str, float], passes_s: dict[str, float]) -> str:
    """Planning time per phase, and the analysis passes inside the trace phase (the pass manager's)."""
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in phases_s.items())
    passes = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in passes_s.items())
    return f"planning time: {phases}\n  passes: {passes}\n"
