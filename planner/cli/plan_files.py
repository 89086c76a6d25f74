"""Reading a plan directory back: every command that loads a `plan.json` goes through here, so each
checks the plan the way `plan` did before it was written."""

from __future__ import annotations

from pathlib import Path

from passes.verify import verify_plan
from planner.core.ir import Plan


def load_checked_plan(path: str | Path) -> Plan:
    """The plan in `path` (a plan directory or a plan.json), verified as `plan` verifies it before
    writing it. Raises PlanFileError (unreadable) or PassError/PlanningError (it breaks an invariant)."""
    plan = Plan.load(path)
    verify_plan(plan)
    return plan
