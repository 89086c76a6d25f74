"""`plan replan OUT --without LABEL [...] -o OUT2` (or `--cluster NEW.yaml`): plan a plan's model again on
the cluster less lost devices, or on a new spec, and emit it as `plan` does.

The previous plan is loaded checked (planner.cli.plan_files); its program's copy of the model file, its
global batch and its options are planned again (planner.replanning) on what is left, and the result is
written to OUT2 under `plan`'s output-directory rules (planner.cli.output_dir: OUT2 may not be OUT,
which holds the model file planned). The new plan records what it replaces (`lineage`); `plan inspect`
and the summary say so.

`replan(out_dir, without, new_out)` is the same from Python, for a supervisor that re-plans in-process
when a device is lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from planner.cli.output_dir import MARKER, check_output_dir, wrote_line
from planner.cli.plan_files import load_checked_plan, plan_file
from planner.core.arguments import OneLineParser
from planner.core.errors import OptionError, PlanFileError, printable
from planner.core.ir import Plan
from planner.options import RunControls


def replan_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan replan", description="Plan a plan's model again on the cluster less lost devices "
                      "(or on a new spec), with the same global batch and options, and emit it as `plan` does.")
    p.add_argument("out", help="the plan directory to re-plan")
    p.add_argument("--without", action="append", default=[], metavar="LABEL",
                   help="a device lost, by its label group/node:local (repeat for several); the others keep "
                        "their labels")
    p.add_argument("--cluster", default=None, metavar="SPEC",
                   help="plan on this spec instead of the plan's (less the --without devices)")
    p.add_argument("-o", "--new-out", required=True, metavar="OUT2",
                   help=f"output directory for the new plan: a new or empty one, or a previous plan's (it holds "
                        f"{MARKER}); never OUT itself, which holds the model file planned")
    p.add_argument("--force", action="store_true",
                   help="replace OUT2 even if it is a non-empty directory hetplan did not write")
    p.add_argument("--stages", type=int, default=None, metavar="N",
                   help="instead of the plan's --stages: force every pipeline to N stages (0: the search chooses)")
    p.add_argument("--no-use-all-devices", action="store_true",
                   help="drop the plan's --use-all-devices: the search may leave devices idle")
    return p


def cmd_replan(argv: list[str]) -> int:
    args = replan_parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.stages is not None:
        overrides["stages"] = args.stages or None
    if args.no_use_all_devices:
        overrides["use_all_devices"] = False
    planned = replan(Path(args.out), args.without, Path(args.new_out), cluster=args.cluster, force=args.force,
                     overrides=overrides, echo=True)
    for warning in planned.warnings:
        print(f"plan: warning: {printable(warning)}", file=sys.stderr)
    return 0


def replan(out_dir: Path, without: Sequence[str], new_out: Path, *, cluster: str | Path | None = None,
           force: bool = False, overrides: Mapping[str, Any] | None = None, controls: RunControls | None = None,
           echo: bool = False) -> Plan:
    """Plan the model of the plan in `out_dir` again on its cluster less the devices labelled `without`
    (or on the spec `cluster`, less those), with its global batch and options (but `overrides`: PlanOptions
    fields by name, e.g. {"stages": None}); write the new plan directory `new_out` as `plan -o` does and
    return its plan. `controls` as for planner.api.plan (off the main thread: `trace_timeout_s=None`, the
    time limit needs SIGALRM); `echo`: print the summary as `plan` does. Raises HetplanError subclasses."""
    from planner.api import plan
    from planner.cli.plan_cmd import write_plan_dir
    from planner.replanning import check_device_options, cluster_left, lineage, options_from_pairs, with_overrides

    if not without and cluster is None:
        raise OptionError("nothing to re-plan for: no device lost and no new spec", field="--without",
                          fix="name the lost devices with --without group/node:local, or give --cluster SPEC")
    source = plan_file(out_dir)
    previous = load_checked_plan(out_dir)
    model = source.parent / "program" / "model.py"
    if previous.program is None or not model.is_file():
        raise PlanFileError("the plan has no program (a cost-only plan of an ONNX graph) to re-plan", file=str(source),
                            fix="plan the model file again with `plan MODEL --cluster SPEC`")
    options = with_overrides(options_from_pairs(previous.inputs.options, str(source)), overrides or {})
    inputs = [path for path in (model, cluster, options.calibration) if path is not None]
    check_output_dir(new_out, inputs=inputs, force=force)     # before planning, not after it
    spec = cluster_left(previous, without, cluster, str(source))
    check_device_options(options, spec, spec.lost)
    result = plan(model, spec, options, controls or RunControls())
    planned = dataclasses.replace(result.plan, program=previous.program,
                                  lineage=lineage(source, without, spec))
    shown = write_plan_dir(new_out, planned, result, model, inputs=inputs, force=force)
    if echo:
        print(shown + "\n" + wrote_line(new_out))
    return planned
