"""Event simulator of a plan's schedule: iteration time, busy time, bubbles, Gantt chart.

    from backends.sim import simulate_plan, render_gantt
    result = simulate_plan(plan, spec)
    print(result.iteration_s); print(render_gantt(result))
"""

from __future__ import annotations

from backends.sim.engine import SimResult, Span, simulate
from backends.sim.gantt import render_gantt
from backends.sim.inputs import ReplicaWork, SimInput, StageWork, SyncWork, from_plan
from planner.ir import Plan
from planner.spec import ClusterSpec


def simulate_plan(plan: Plan, spec: ClusterSpec) -> SimResult:
    """Simulate one iteration of `plan` on the cluster `spec` it was planned for."""
    return simulate(from_plan(plan, spec))


__all__ = ["ReplicaWork", "SimInput", "SimResult", "Span", "StageWork", "SyncWork", "from_plan",
           "render_gantt", "simulate", "simulate_plan"]
