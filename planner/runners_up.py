"""Why this plan: the other plans the search saw, simulated under the same model, and what made
them slower (`plan inspect` shows them).

The alternatives are the ILP's best plan of the other topology regime (replicas inside one node,
or spread over the network) and every baseline strategy that fits (uniform, fastest, megatron,
metis). Each is simulated (backends.sim) as the chosen plan is, so they compare on one clock.
"""

from __future__ import annotations

import dataclasses

from backends.report.text import layout, signed_time
from backends.sim import simulate_plan
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan, RunnerUp


def why_slower(chosen: Plan, chosen_sim_s: float, other: Plan, other_sim_s: float) -> str:
    """The differences that make `other` slower (or say that it is not, in simulation)."""
    ce, oe = chosen.estimates, other.estimates
    parts = []
    d_pipe, d_sync = oe.pipeline_s - ce.pipeline_s, oe.sync_s - ce.sync_s
    if abs(d_pipe) >= 0.01 * ce.iteration_s:
        parts.append(f"pipeline {signed_time(d_pipe)} (bubble {oe.bubble_fraction:.0%} vs {ce.bubble_fraction:.0%})")
    if abs(d_sync) >= 0.01 * ce.iteration_s:
        parts.append(f"gradient sync {signed_time(d_sync)}")
    if other.world_size != chosen.world_size:
        parts.append(f"{other.world_size} devices vs {chosen.world_size}")
    detail = "; ".join(parts) if parts else "same estimate within 1%"
    ratio = other_sim_s / chosen_sim_s if chosen_sim_s > 0 else float("inf")
    if ratio < 1.0:
        return (f"{1 / ratio:.2f}x faster in simulation although its estimate is "
                f"{oe.iteration_s / ce.iteration_s:.2f}x the chosen one's ({detail})")
    return f"{ratio:.2f}x slower: {detail}"


def with_runners_up(plan: Plan, alternatives: list[tuple[str, Plan]], spec: ClusterSpec) -> Plan:
    """`plan` with its simulated time and the alternatives ranked by simulated time in its facts."""
    chosen_s = simulate_plan(plan, spec).iteration_s
    ups = []
    for name, other in alternatives:
        other_s = simulate_plan(other, spec).iteration_s
        ups.append(RunnerUp(name=name, estimated_iteration_s=other.estimates.iteration_s,
                            simulated_iteration_s=other_s, pipeline_s=other.estimates.pipeline_s,
                            sync_s=other.estimates.sync_s, devices_used=other.world_size, layout=layout(other),
                            why_slower=why_slower(plan, chosen_s, other, other_s)))
    ups.sort(key=lambda u: (u.simulated_iteration_s, u.name))
    facts = dataclasses.replace(plan.solver, runners_up=tuple(ups), simulated_iteration_s=chosen_s)
    return dataclasses.replace(plan, solver=facts)
