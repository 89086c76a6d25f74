"""A CPU plan priced for the processes it runs, not for the spec's.

CPU processes of one host share its cores (costmodel.host_sharing), so how fast a candidate's compute runs
depends on how many processes the candidate itself puts on the host. The search prices every candidate at
the spec's count; a plan that runs fewer (it leaves devices idle) was priced too slow. `priced_for_own`
plans again on the devices that plan uses, with the calibration priced for their count, until the plan
runs as many processes as it was priced for. Every round's space holds the previous round's plan, now
priced as it will run, so the plan kept is at least as fast as it; plans that use every device are priced
right the first time and never re-planned.

The plan of a later round is made on the spec less the idle devices (ClusterSpec.without), whose device
indices count only the devices left; `on_spec` re-indexes it onto the whole spec by label, so the rest of
the flow (communication checks, runners-up, the program) reads it as any plan of the spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from costmodel import host_sharing
from costmodel.calibration import Calibration
from costmodel.tables import CostTables
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan

Cost = Callable[[ClusterSpec, Calibration], CostTables]
Search = Callable[[ClusterSpec, CostTables], tuple[Plan, list[tuple[str, Plan]]]]


@dataclass(frozen=True)
class Priced:
    plan: Plan                              # on the whole spec's device indices
    alternatives: list[tuple[str, Plan]]    # the search's other variants, likewise
    calibration: Calibration | None         # as the plan was priced (for cost_notes)
    rounds: int                             # searches made (1: the plan was priced right at once)


def priced_for_own(plan: Plan, alternatives: list[tuple[str, Plan]], spec: ClusterSpec,
                   calibration: Calibration | None, cost: Cost, search: Search) -> Priced:
    """`plan` (the search's, priced with `calibration` on `spec`), or where it runs fewer processes on a
    host than `calibration` was priced for, the plan searched again on its devices priced for their
    count (`cost` builds the tables, `search` runs the strategy), repeated until the counts agree."""
    rounds, on = 1, spec
    while calibration is not None and calibration.kind == "cpu":
        runs = host_sharing.plan_host_processes(plan, on, calibration)
        if runs >= calibration.priced_processes:
            break
        used = set(plan.devices)
        on = on.without([d.label for d in on.devices() if d.label not in used], flag="(plan devices)")
        calibration = host_sharing.priced_for(calibration, host_sharing.host_processes(on, calibration))
        plan, alternatives = search(on, cost(on, calibration))
        rounds += 1
    if on is spec:
        return Priced(plan, alternatives, calibration, rounds)
    return Priced(on_spec(plan, spec), [(name, on_spec(p, spec)) for name, p in alternatives], calibration, rounds)


def on_spec(plan: Plan, spec: ClusterSpec) -> Plan:
    """`plan`, made on part of `spec`, with its stages' device indices those of `spec` (by label)."""
    index = {d.label: d.index for d in spec.devices()}
    replicas = tuple(dataclasses.replace(r, stages=tuple(
        dataclasses.replace(s, device=index[s.device_label], tp_devices=tuple(index[x] for x in s.tp_device_labels))
        for s in r.stages)) for r in plan.replicas)
    return dataclasses.replace(plan, replicas=replicas)
