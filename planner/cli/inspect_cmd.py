"""`plan inspect OUT`: the plan as tables, why it won, its memory and its simulated timeline."""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.report.terminal import memory_table, runners_up_section, simulation_section, summary
from planner.core.ir import Plan
from planner.frontend.cluster import load_cluster


def cmd_inspect(argv: list[str]) -> int:
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
