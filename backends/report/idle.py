"""Where the plan's bubble comes from: its idle device time split by cause.

The bubble a plan reports (Estimates.bubble_fraction) is 1 - busy device-seconds / (devices x step). A
rank of replica r, busy b for the step T, idles T - b, which splits exactly into

    T - b = (T - P)                 gradient sync: the step after the pipelines
          + (P - P_r)               uneven replicas: its replica ends before the slowest one, P
          + O_r                     optimizer step: the replica's (its slowest stage's, ZeRO's gather included)
          + (P_r - O_r - max_r b)   fill and drain: its pipeline's makespan beyond its busiest rank's work
                                    (the schedule's warm-up and cool-down, and the cuts' transfers)
          + (max_r b - b)           uneven stages: its stage has less work than its pipeline's busiest

so the fractions below, summed over ranks and divided by devices x step, add up to the bubble. (A plan
written before replicas recorded their optimizer step counts it in fill and drain.)
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core.ir import Plan


@dataclass(frozen=True)
class IdleParts:
    """Fractions of the plan's device-seconds (devices x step) idle, by cause; they sum to the bubble."""

    fill_drain: float
    uneven_stages: float
    uneven_replicas: float
    gradient_sync: float
    optimizer_step: float

    @property
    def total(self) -> float:
        return self.fill_drain + self.uneven_stages + self.uneven_replicas + self.gradient_sync + self.optimizer_step


def idle_parts(plan: Plan) -> IdleParts:
    e = plan.estimates
    step_s = e.iteration_s
    if step_s <= 0 or plan.world_size == 0:
        return IdleParts(0.0, 0.0, 0.0, 0.0, 0.0)
    fill = uneven_stages = uneven_replicas = optimizer = 0.0
    for replica in plan.replicas:
        busy = [e.busy_s[r] for r in replica.ranks]
        ranks, busiest = len(busy), max(busy)
        uneven_replicas += ranks * (e.pipeline_s - replica.estimated_s)
        optimizer += ranks * replica.optimizer_s
        fill += ranks * (replica.estimated_s - replica.optimizer_s - busiest)
        uneven_stages += ranks * busiest - sum(busy)
    sync = plan.world_size * (step_s - e.pipeline_s)
    device_s = step_s * plan.world_size
    return IdleParts(fill / device_s, uneven_stages / device_s, uneven_replicas / device_s, sync / device_s,
                     optimizer / device_s)


def idle_causes(plan: Plan) -> str:
    """The bubble's causes, largest first, those under half a percent left out: `fill and drain 18%,
    uneven stages 6%, ...` (`none` where every one is)."""
    parts = idle_parts(plan)
    named = sorted([("fill and drain", parts.fill_drain), ("uneven stages", parts.uneven_stages),
                    ("uneven replicas", parts.uneven_replicas), ("gradient sync", parts.gradient_sync),
                    ("optimizer step", parts.optimizer_step)],
                   key=lambda p: -p[1])
    return ", ".join(f"{name} {fraction:.0%}" for name, fraction in named if fraction >= 0.005) or "none"
