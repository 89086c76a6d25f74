"""The summary's lines on what a plan replaces (`plan replan`) and on checkpointing it: what a checkpoint
costs and how often Young/Daly says to take one (costmodel.checkpoint)."""

from __future__ import annotations

from backends.report.text import GIB, format_time, printable
from planner.core.ir import Plan
from planner.core.units import BYTES_PER_MIB

S_PER_MIN = 60.0
S_PER_HOUR = 3600.0


def format_duration(seconds: float) -> str:
    """A duration that may run to hours: `2.4 h`, `13.5 min`, else format_time's s / ms / us."""
    if seconds >= S_PER_HOUR:
        return f"{seconds / S_PER_HOUR:.1f} h"
    if seconds >= S_PER_MIN:
        return f"{seconds / S_PER_MIN:.1f} min"
    return format_time(seconds)


def format_bytes(nbytes: float) -> str:
    """`1.25 GiB`, or `3.4 MiB` under a GiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / BYTES_PER_MIB:.3g} MiB"


def lineage_line(plan: Plan) -> str | None:
    """`re-planned from DIR without a/0:0 (on SPEC)`, or None for a plan made by `plan`."""
    lineage = plan.lineage
    if lineage is None:
        return None
    how = f" without {', '.join(printable(label) for label in lineage.without)}" if lineage.without else ""
    return (f"re-planned from {printable(lineage.plan_dir)}{how}\n  (its plan.json sha256 "
            f"{lineage.plan_digest[:12]}), on {printable(lineage.cluster) or 'the cluster given'}")


def checkpoint_lines(plan: Plan) -> list[str]:
    """A checkpoint's size, blocking and background cost, and the suggested interval (when MTBFs are known)."""
    advice = plan.checkpoint
    if advice is None:
        return []
    lines = [f"checkpoint: {format_bytes(advice.state_bytes)} on the largest rank ({advice.state_rank}); the step "
             f"pauses {format_time(advice.blocking_s)} to stage it,",
             f"  then {format_duration(advice.write_s)} to write it in the background "
             f"({advice.storage_write_bytes_s / 1e9:g} GB/s per node)"]
    if advice.interval_s is None or advice.job_mtbf_s is None or advice.interval_steps is None:
        return [*lines, "  no checkpoint interval: no device of the plan gives mtbf_hours in the spec"]
    unknown = plan.world_size - advice.devices_with_mtbf
    partial = f"; {unknown} device(s) without mtbf_hours not counted" if unknown else ""
    return [*lines, f"  checkpoint every {advice.interval_steps} step(s) ({format_duration(advice.interval_s)}: "
                    f"Young/Daly, job MTBF {format_duration(advice.job_mtbf_s)}{partial})"]
