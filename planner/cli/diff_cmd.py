"""`plan diff A B`: what changed between two plans (plan directories or plan.json files), and what it costs."""

from __future__ import annotations

from backends.report.diff import diff_text
from planner.cli.plan_files import load_checked_plan
from planner.core.arguments import OneLineParser


def cmd_diff(argv: list[str]) -> int:
    p = OneLineParser(prog="plan diff", description="Compare two plans side by side.")
    p.add_argument("a", help="the first plan directory (or plan.json)")
    p.add_argument("b", help="the second plan directory (or plan.json)")
    args = p.parse_args(argv)
    # both plans are checked, but may predate an edit of their model or spec: a diff only reads them
    a, b = (load_checked_plan(path, allow_changed=True) for path in (args.a, args.b))
    print(diff_text(a, b, args.a, args.b), end="")
    return 0
