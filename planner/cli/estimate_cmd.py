"""`plan estimate MODEL.py --cluster SPEC.yaml --layout LAYOUT [-o OUT]`: how fast a layout the user wrote
would be, and whether it fits.

LAYOUT is a layout file (YAML, planner.frontend.layout), a plan (`out/plan.json` or `out/`: its own
layout), or the shorthand `dp=4,tp=2,pp=2,mb=1` (dp replicas of pp stages of tp devices, equal blocks
per stage, micro-batch size mb, on the fastest device classes first; `gbs=` the global batch where
--global-batch does not give it). Prints the cost model's estimate (the planner's: step time,
throughput, bubble), the event simulation, each stage's memory against its device's capacity and what
does not fit. A layout that fits is verified like any plan and, with -o, written like one (plan.json,
summary.txt, program/). One that does not fit exits NOT_FIT_EXIT_CODE and writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.cli.output_dir import MARKER, check_output_dir, wrote_line
from planner.core.arguments import OneLineParser, positive_number, whole_number
from planner.core.errors import printable

if TYPE_CHECKING:
    from planner.estimate import EstimateResult

NOT_FIT_EXIT_CODE = 5          # the layout was estimated, and some stage needs more memory than its device has
MAX_GLOBAL_BATCH = 1 << 20     # as planner.options
GIB = float(1 << 30)
# the options a layout may also say: a flag given on the command line must agree with it
SHARED = ("global_batch", "precision", "compression", "activation_compression", "memory_margin")
DEFAULTS: dict[str, Any] = {"global_batch": 64, "precision": "auto", "compression": "none",
                            "activation_compression": "none", "memory_margin": 0.1}


def estimate_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan estimate", description=(
        "Estimate and simulate a layout you wrote. LAYOUT: a layout file (YAML: per replica its devices, "
        "stages as a count or block/layer ranges, tp, micro_batch, micro_batches, share, schedule, "
        "compression; defaults: one stage, equal blocks per stage, tp 1, micro-batches = stages, the global "
        "batch split equally, 1f1b, no compression), a plan (OUT/plan.json or OUT: its own layout), or "
        "the shorthand dp=D,tp=T,pp=P,mb=M[,gbs=B]: D replicas of P stages of T devices, equal blocks, "
        "micro-batch size M, on the fastest device classes first, each replica on one class. "
        f"Exit {NOT_FIT_EXIT_CODE} when a stage does not fit its device (nothing is written then)."))
    p.add_argument("model", help="model file defining model() and batch(batch_size, step)")
    p.add_argument("--cluster", required=True, help="cluster spec (YAML)")
    p.add_argument("--layout", required=True, help="layout file, plan.json or plan directory, or dp=,tp=,pp=,mb=")
    p.add_argument("-o", "--out", default=None,
                   help=f"write the layout's plan and program here, as `plan -o` does (a new or empty directory, "
                        f"or a previous plan's: it holds {MARKER}); only when the layout fits")
    p.add_argument("--force", action="store_true", help="replace OUT even if hetplan did not write it")
    p.add_argument("--write-layout", default=None, metavar="FILE",
                   help="also write the layout estimated as a layout file (a plan's, or the shorthand's spelled "
                        "out), to edit and estimate again")
    p.add_argument("--global-batch", type=whole_number("--global-batch", MAX_GLOBAL_BATCH), default=None,
                   help="samples per step (default: the layout's global_batch, the shorthand's gbs, else 64)")
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16", "fp16"], help="default: auto")
    p.add_argument("--compression", default=None, choices=["none", "auto", "fp16", "bf16", "powersgd", "onebit"],
                   help="gradient compression where the layout does not say it (default: none)")
    p.add_argument("--activation-compression", default=None, choices=["none", "auto", "fp16", "bf16", "int8"],
                   help="compression on pipeline links where the layout does not say it (default: none)")
    p.add_argument("--memory-margin", type=float, default=None, help="fraction of device memory kept free (0.1)")
    p.add_argument("--calibration", default=None, metavar="FILE", help="calibration file from `plan profile`")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="the program's optimizer")
    p.add_argument("--lr", type=positive_number("--lr"), default=1e-3, help="the program's learning rate")
    p.add_argument("--trace-timeout", type=positive_number("--trace-timeout"), default=None, metavar="SECONDS",
                   help="stop the model file's code after this long (default: 300)")
    p.add_argument("--model-fn", default="model")
    p.add_argument("--batch-fn", default="batch")
    p.add_argument("--loss-fn", default="loss_fn")
    p.add_argument("--dataset-fn", default="dataset")
    return p


def cmd_estimate(argv: list[str]) -> int:
    args = estimate_parser().parse_args(argv)
    inputs = [path for path in (args.model, args.cluster, args.calibration) if path]
    if args.out is not None:
        check_output_dir(Path(args.out), inputs=inputs, force=args.force)   # before estimating, not after
    # imported once the arguments are known good: `plan estimate --help` needs no torch
    import dataclasses

    from planner.cli.plan_cmd import write_plan_dir
    from planner.core.ir import ProgramDefaults
    from planner.estimate import estimate, merge_options
    from planner.frontend.layout import load_layout, to_yaml
    from planner.options import PlanOptions, RunControls, check_options

    layout = load_layout(args.layout)
    given = {name for name in SHARED if getattr(args, name) is not None}
    names = {"model": args.model_fn, "batch": args.batch_fn, "loss_fn": args.loss_fn, "dataset": args.dataset_fn}
    shared: dict[str, Any] = {name: getattr(args, name) if name in given else DEFAULTS[name] for name in SHARED}
    options = PlanOptions(**shared,
                          calibration=args.calibration, optimizer=args.optimizer,
                          names={k: v for k, v in names.items() if v != k})
    options = merge_options(layout, options, given)
    check_options(dataclasses.replace(options, strategy="ilp"))   # every value but the strategy, as `plan` checks
    controls = RunControls(**({"trace_timeout_s": args.trace_timeout} if args.trace_timeout else {}))
    found = estimate(args.model, args.cluster, layout, options, controls)
    print(report(found))
    if args.write_layout is not None:
        Path(args.write_layout).write_text(to_yaml(found.layout))
        print(f"wrote the layout to {args.write_layout}")
    if not found.fits:
        return NOT_FIT_EXIT_CODE
    if args.out is not None:
        planned = dataclasses.replace(found.plan, program=ProgramDefaults(
            learning_rate=args.lr, optimizer=args.optimizer, functions=tuple(sorted(options.names.items()))))
        write_plan_dir(Path(args.out), planned, found.result, Path(args.model), inputs=inputs, force=args.force)
        for warning in planned.warnings:
            print(f"plan: warning: {printable(warning)}", file=sys.stderr)
        print(wrote_line(Path(args.out)))
    return 0


def report(found: EstimateResult) -> str:
    """What `plan estimate` prints: estimate, simulation, memory per stage, what does not fit."""
    from backends.report.idle import idle_causes
    from backends.report.text import format_time, table
    from costmodel.memory import capacity_bytes

    plan, sim = found.plan, found.simulation
    e = plan.estimates
    lines = [
        f"layout {printable(found.layout.source)} on {printable(plan.inputs.cluster_name)}: {len(plan.replicas)} "
        f"replica(s) on {plan.world_size} device(s), global batch {plan.global_batch}, {len(plan.blocks)} blocks",
        f"estimate:  step {format_time(e.iteration_s)} (pipelines {format_time(e.pipeline_s)} + gradient sync "
        f"{format_time(e.sync_s)}), {e.throughput_samples_s:,.1f} samples/s, bubble {e.bubble_fraction:.0%}",
        f"           bubble by cause: {idle_causes(plan)}",
        f"simulated: step {format_time(sim.iteration_s)}, {sim.throughput_samples_s:,.1f} samples/s, "
        f"bubble {sim.bubble_fraction:.0%}",
    ]
    rows = []
    for r in plan.replicas:
        for st in r.stages:
            need = e.memory_bytes[st.rank]
            offered = capacity_bytes(e.capacity_bytes[st.rank], e.memory_margin)
            devices = ",".join(label for _, _, label in st.rank_devices())
            rows.append([f"{r.index}/{st.index}", devices, st.device_type, f"{st.first_block}-{st.last_block}",
                         "tp" + str(st.tp_degree), "yes" if st.recompute else "no", str(r.batch_share),
                         f"{r.micro_batch_sizes[0]} x{len(r.micro_batch_sizes)}", r.schedule,
                         f"{need / GIB:.2f}", f"{offered / GIB:.2f}", "yes" if need <= offered else "NO"])
    lines += ["", table(["rep/stage", "devices", "type", "blocks", "tp", "recompute", "share", "micro", "schedule",
                         "need GiB", "offers GiB", "fits"], rows)]
    if found.overs:
        lines += ["", f"does not fit (capacity after the {e.memory_margin:.0%} memory margin):"]
        lines += [f"  replica {o.replica} stage {o.stage} on {printable(o.device)} (rank {o.rank}) needs "
                  f"{o.need_bytes / GIB:.2f} GiB of {o.capacity_bytes / GIB:.2f} GiB: "
                  f"{o.over_bytes / GIB:.2f} GiB over" for o in found.overs]
    return "\n".join(lines)
