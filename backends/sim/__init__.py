"""Event simulator of a plan's schedule: iteration time, busy time, bubbles, Gantt chart.

    from backends.sim import simulate_plan
    result = simulate_plan(plan, spec)
    print(result.iteration_s)       # backends.report.gantt draws it
"""

from __future__ import annotations

from backends.sim.engine import SimResult, Span, simulate
from backends.sim.inputs import ReplicaWork, SimInput, StageWork, SyncWork, from_plan
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan


def simulate_plan(plan: Plan, spec: ClusterSpec, timeline: bool = True) -> SimResult:
    """Simulate one iteration of `plan` on the cluster `spec` it was planned for (without `timeline`:
    its times only, no spans to draw)."""
    return simulate(from_plan(plan, spec), timeline)


__all__ = ["ReplicaWork", "SimInput", "SimResult", "Span", "StageWork", "SyncWork", "from_plan",
           "simulate", "simulate_plan"]
