"""`plan inspect OUT`: the plan as tables, why it won, its memory and its simulated timeline.

The plan is loaded checked (planner.cli.plan_files): an edited or stale plan is refused unless
`--allow-changed`. A re-planned plan's spec is taken less the devices it was made without
(`inputs.lost_devices`). Nothing outside the plan directory is read but the recorded spec, and that only
when its digest is the recorded one (or the spec `--cluster` names): a path edited into the plan is
never opened, let alone printed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.report.html import PAGE_MARK, render_html
from backends.report.terminal import memory_table, runners_up_section, simulation_section, summary
from backends.report.text import printable
from backends.sim import simulate_plan
from planner.cli.output_dir import write_text_atomically
from planner.cli.plan_files import load_checked_plan, plan_file, recorded_spec
from planner.core.arguments import OneLineParser
from planner.core.cluster import ClusterSpec
from planner.core.errors import OptionError, SpecError
from planner.core.ir import Plan
from planner.core.output_file import check_output_file
from planner.frontend.cluster import load_cluster


def inspect_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="plan inspect", description="Show a plan.")
    p.add_argument("out", help="plan directory (or plan.json)")
    p.add_argument("--cluster", default=None, help="cluster spec for the simulated Gantt chart "
                   "(default: the one the plan was made for, if it is still the same file)")
    p.add_argument("--allow-changed", action="store_true",
                   help="show the plan even if the model file or the spec changed since planning")
    p.add_argument("--html", type=Path, default=None, metavar="FILE",
                   help="write the plan as one self-contained HTML page (cluster, timeline, memory, why) instead")
    p.add_argument("--force", action="store_true",
                   help="with --html: replace FILE even when it is not a page plan inspect wrote")
    return p


def cmd_inspect(argv: list[str]) -> int:
    args = inspect_parser().parse_args(argv)
    plan = load_checked_plan(args.out, allow_changed=args.allow_changed)
    if args.html is not None:     # before anything is simulated: a page never replaces a file of the user's
        inputs = [plan_file(args.out), plan.inputs.model_path, plan.inputs.cluster_path, args.cluster or ""]
        check_output_file(args.html, option="--html", is_ours=lambda head: PAGE_MARK.encode() in head[:4096],
                          inputs=[p for p in inputs if p], force=args.force)
    spec_path = args.cluster or recorded_spec(plan)
    spec = _cluster_planned_on(plan, spec_path) if spec_path else None
    if spec is not None:
        _check_devices(plan, spec, str(spec_path))
    if args.html is not None:
        write_text_atomically(args.html, render_html(plan, spec, simulate_plan(plan, spec) if spec else None))
        print(f"wrote {printable(str(args.html))}" + ("" if spec else " (no cluster picture or timeline: "
                                                  "the spec planned with is not there or changed; pass --cluster)"))
        return 0
    print(summary(plan))
    print(runners_up_section(plan) + "\n")
    print(memory_table(plan) + "\n")
    if spec is not None:
        print(simulation_section(plan, spec))
    else:
        recorded = printable(plan.inputs.cluster_path or "?")
        print(f"(no simulation: the cluster spec planned with ({recorded}) is not there or changed; pass --cluster)")
    return 0


def _cluster_planned_on(plan: Plan, spec_path: str | Path) -> ClusterSpec:
    """The spec at `spec_path` less the devices the plan was made without (`plan replan`)."""
    spec = load_cluster(spec_path)
    try:
        return spec.without(plan.inputs.lost_devices, flag="inputs.lost_devices")
    except OptionError as exc:
        raise SpecError(f"not the cluster this plan was made for: {exc.message}", file=str(spec_path),
                        fix="pass the spec the plan was made for with --cluster") from exc


def _check_devices(plan: Plan, spec: ClusterSpec, file: str) -> None:
    """The simulation places each stage on the spec's device of the recorded index: it must be there,
    with the label the plan recorded."""
    devices = spec.devices()
    for replica in plan.replicas:
        for stage in replica.stages:
            if not 0 <= stage.device < len(devices) or devices[stage.device].label != stage.device_label:
                raise SpecError(f"not the cluster this plan was made for: rank {stage.rank} runs on "
                                f"{stage.device_label} (device {stage.device}), which the spec does not have there",
                                file=file, fix="pass the spec the plan was made for with --cluster")
