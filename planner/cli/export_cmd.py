"""`plan export OUT --onnx DIR`: each distinct stage of a plan as an ONNX file, checked in onnxruntime.
`plan export OUT --safetensors DIR`: the weights a run of the plan trained, from its checkpoint.

The plan is loaded checked (planner.cli.plan_files), the model from the plan directory's copy of it
(`program/model.py`, whose digest the check compares). DIR is written like `plan -o`: built beside it and
renamed into place, so a failed export leaves nothing half-written (nor an earlier DIR changed). A stage
whose ONNX file differs from torch by more than `--tolerance` fails the command (exit 4) after the
table of every stage is shown. How: backends.onnx, backends.torchdist.export_weights.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from planner.cli.output_dir import MARKER, check_output_dir, write_atomically
from planner.cli.plan_files import load_checked_plan, plan_file
from planner.core.arguments import OneLineParser
from planner.core.errors import OptionError, PassError, PlanFileError
from planner.core.ir import Plan

if TYPE_CHECKING:   # the exporter imports torch: `plan export --help` need not
    from backends.onnx.export import StageFile

DEFAULT_TOLERANCE = 1e-4      # backends.onnx.export.DEFAULT_TOLERANCE: fp32 in onnxruntime against torch
DTYPES = ("float32", "bfloat16", "float16")
RUN_CHECKPOINTS = Path("run") / "ckpt"     # under OUT: where `plan run --checkpoint-every` saves


def export_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan export", description="Export each stage of a plan to ONNX and check it in "
                      "onnxruntime against the torch stage on the same inputs.")
    p.add_argument("out", help="plan directory (or plan.json)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--onnx", metavar="DIR",
                      help=f"directory for stage<k>_replica<r>.onnx: a new or empty one, or a previous export's "
                           f"(it holds {MARKER}), replaced atomically")
    what.add_argument("--safetensors", metavar="DIR",
                      help="directory for the trained weights from --checkpoint, whole, by the model's names: "
                           "model.safetensors, or shards listed by model.safetensors.index.json (as "
                           "save_pretrained writes them); new, empty or a previous export's")
    p.add_argument("--force", action="store_true",
                   help="replace DIR even if it is a non-empty directory hetplan did not write")
    p.add_argument("--checkpoint", metavar="CKPT", default=None,
                   help="with --safetensors: a checkpoint root (its latest complete step) or one step_<N> folder "
                        "(default: OUT/run/ckpt, where `plan run --checkpoint-every` saves)")
    p.add_argument("--max-shard-gib", type=float, default=None, metavar="GIB",
                   help="with --safetensors: the largest file before the weights are cut into shards "
                        "(default: save_pretrained's 5 GB)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="with --safetensors: cast every tensor (default: as trained)")
    p.add_argument("--strip-prefix", default="", metavar="PREFIX",
                   help="with --safetensors: write each name without PREFIX, e.g. `lm.` for a model file that "
                        "wraps a Hugging Face model as self.lm (its from_pretrained then reads the files)")
    p.add_argument("--micro-batch", type=int, default=None, metavar="ROWS",
                   help="trace every stage at this many rows (default: each replica's first micro-batch size)")
    p.add_argument("--seed", type=int, default=0, help="weights of `torch.manual_seed(SEED); model()`")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="largest |onnxruntime - torch| accepted on any output")
    p.add_argument("--allow-changed", action="store_true",
                   help="export a plan whose model file or spec changed since it was planned")
    return p


def cmd_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    if args.micro_batch is not None and not 1 <= args.micro_batch <= 1 << 16:
        raise OptionError(f"{args.micro_batch} is not a number of rows", field="--micro-batch",
                          fix="pass a micro-batch size from 1, e.g. --micro-batch 2")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise OptionError(f"{args.tolerance} is not a tolerance", field="--tolerance", fix="pass e.g. 1e-4")
    plan = load_checked_plan(args.out, allow_changed=args.allow_changed)
    if args.safetensors is not None:
        return _export_weights(args, plan)
    model_path = _model_path(plan, Path(args.out))
    inputs = [plan_file(args.out), model_path]
    check_output_dir(Path(args.onnx), inputs=inputs, force=args.force, option="--onnx")   # before any work
    # torch and the exporter are imported once the plan and the folder are known good
    from backends.onnx import export_plan
    from planner import frontend

    names = dict(plan.program.functions) if plan.program else {}
    model_file = frontend.load_model_file(model_path, names)
    files: list[StageFile] = []

    def fill(tmp: Path) -> None:
        files.extend(export_plan(plan, model_file, tmp, plan_file=str(plan_file(args.out)), seed=args.seed,
                                 micro_batch=args.micro_batch, opset=args.opset))
        worst = max(files, key=lambda f: f.max_abs_diff)
        if worst.max_abs_diff > args.tolerance:
            print(stage_table(files))
            raise PassError(f"stage {worst.stage} (replica {worst.replicas[0]}) differs from torch in onnxruntime "
                            f"by {worst.max_abs_diff:.3g}, more than --tolerance {args.tolerance:g}",
                            fix="report this with the model file; nothing was written")

    write_atomically(Path(args.onnx), fill, inputs=inputs, force=args.force, option="--onnx")
    print(stage_table(files))
    opsets = sorted({f.opset for f in files})
    print(f"\nwrote {len(files)} ONNX file(s) to {args.onnx} (opset {', '.join(map(str, opsets))}); every stage "
          f"matches torch in onnxruntime within {args.tolerance:g}")
    return 0


def _export_weights(args: argparse.Namespace, plan: Plan) -> int:
    """`--safetensors DIR`: the checkpoint's model tensors, whole, written as safetensors files."""
    if args.max_shard_gib is not None and not (math.isfinite(args.max_shard_gib) and args.max_shard_gib > 0):
        raise OptionError(f"{args.max_shard_gib} is not a size", field="--max-shard-gib", fix="pass e.g. 5")
    folder = Path(args.out).parent if Path(args.out).name == "plan.json" else Path(args.out)
    checkpoint = Path(args.checkpoint) if args.checkpoint is not None else folder / RUN_CHECKPOINTS
    model_path = _model_path(plan, Path(args.out))
    inputs = [plan_file(args.out), model_path, checkpoint]
    check_output_dir(Path(args.safetensors), inputs=inputs, force=args.force, option="--safetensors")
    import torch

    from backends.torchdist.export_weights import DEFAULT_MAX_SHARD_BYTES, ExportedWeights, export_weights
    from backends.torchdist.program import checkpoint as checkpoints
    from backends.torchdist.program import materialise
    from planner import frontend

    if args.checkpoint is None and checkpoints.latest_complete(checkpoint) is None:
        raise checkpoints.CheckpointError("no complete checkpoint of this plan's run here", file=str(checkpoint),
                                          fix=f"train with `plan run {args.out} --checkpoint-every N` first, or "
                                              "pass --checkpoint CKPT")

    names = dict(plan.program.functions) if plan.program else {}
    meta = materialise.build_meta(frontend.load_model_file(model_path, names), seed=0)
    max_bytes = DEFAULT_MAX_SHARD_BYTES if args.max_shard_gib is None else max(1, int(args.max_shard_gib * 2**30))
    dtype = getattr(torch, args.dtype) if args.dtype else None
    done: list[ExportedWeights] = []

    def fill(tmp: Path) -> None:
        done.append(export_weights(checkpoint, meta.module, tmp, max_shard_bytes=max_bytes, dtype=dtype,
                                   strip_prefix=args.strip_prefix))

    write_atomically(Path(args.safetensors), fill, inputs=inputs, force=args.force, option="--safetensors")
    result = done[0]
    print(f"wrote {result.tensors} tensors ({_size(result.total_bytes)}) in {len(result.files)} file(s) to "
          f"{args.safetensors}, from {result.checkpoint} (after {result.step} steps)")
    return 0


def stage_table(files: list[StageFile]) -> str:
    """Stage, replicas, rows, inputs, outputs, max abs diff and size of each exported file."""
    from backends.report.text import table

    rows = []
    for f in files:
        rows.append([f.path.name, str(f.stage), ",".join(map(str, f.replicas)), str(f.rows), ", ".join(f.inputs),
                     ", ".join(f.outputs), f"{f.max_abs_diff:.2e}", _size(f.size_bytes)])
    return table(["file", "stage", "replicas", "rows", "inputs", "outputs", "max abs diff", "size"], rows)


def _model_path(plan: Plan, out: Path) -> Path:
    """The model file to export: the plan directory's copy (the program's), else the recorded path."""
    if plan.inputs.model_path.endswith(".onnx"):
        raise PlanFileError("a cost-only plan of an ONNX graph: there is no PyTorch model to export",
                            file=str(plan_file(out)), field="inputs.model_path",
                            fix="plan the PyTorch model file, then export that plan")
    folder = out.parent if out.name == "plan.json" else out
    for candidate in (folder / "program" / "model.py", folder / "model.py", Path(plan.inputs.model_path)):
        if candidate.is_file():
            return candidate
    raise PlanFileError("no model file: neither program/model.py nor the recorded model path is there",
                        file=str(plan_file(out)), field="inputs.model_path",
                        fix="export from the plan directory `plan -o` wrote")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
