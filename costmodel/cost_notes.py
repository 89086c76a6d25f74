"""What a plan's estimates rest on, said in its warnings: placeholder figures (`costmodel.placeholders`)
and CPU compute priced for another number of processes per host than the plan runs
(`costmodel.host_sharing`). `planner.api` adds these lines to the chosen plan's `warnings`."""

from __future__ import annotations

from costmodel.calibration import Calibration
from costmodel.host_sharing import priced_process_notes
from costmodel.placeholders import placeholder_notes
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan


def cost_notes(plan: Plan, spec: ClusterSpec, calibration: Calibration | None) -> tuple[str, ...]:
    """The plan's cost warnings, one line each (none when its figures are measured for its shape).
    `calibration` is the one the plan was costed with (`host_sharing.for_spec` of the loaded file)."""
    return placeholder_notes(plan, spec, calibration) + priced_process_notes(plan, spec, calibration)
