"""Cost per sample as the objective (`--objective cost`, when the spec gives prices).

Cost per sample = iteration time x price per hour of the devices used / 3600 / global batch: a
product of two decisions, so not linear. The search walks a ladder of time limits instead: the
fastest plan's time T*, then T* x 1.15, 1.35, 1.6, 2, 3; at each it minimises the price per hour
of the devices used (a linear objective, ilp.solve_regime with `max_time_ns`) and keeps the
cheapest per sample. Fewer, cheaper devices running longer can win; none of the rungs is worse
than the fastest plan's own cost.
"""

from __future__ import annotations

import math

from costmodel.tables import CostTables
from planner.core.errors import PlanningError
from planner.core.units import NS_PER_S
from planner.search import candidates, ilp
from planner.search.solver import SolverSettings

TIME_LADDER = (1.0, 1.15, 1.35, 1.6, 2.0, 3.0)


def price_per_hour(tables: CostTables, solution: candidates.Solution) -> float:
    return sum(c.replicas * sum(tables.classes[ci].price_per_hour or 0.0 for ci in c.config.classes)
               for c in solution.choices)


def cost_per_sample(tables: CostTables, solution: candidates.Solution) -> float:
    return solution.objective_s * price_per_hour(tables, solution) / 3600.0 / tables.global_batch


def check_prices(tables: CostTables, source: str | None) -> None:
    missing = [t.name for t in tables.classes if t.price_per_hour is None]
    if missing:
        raise PlanningError(f"--objective cost needs a price for every node group; none for {', '.join(missing)}",
                            file=source, field="price_per_hour",
                            fix="add price_per_hour (USD per device-hour) to those node groups or their "
                                "device types, or plan with --objective time")


def solve_cost(tables: CostTables, configs: list[candidates.Config], settings: SolverSettings,
               use_all_devices: bool = False, min_replicas: int = 1) -> list[candidates.Solution]:
    """The cheapest plan per sample over the time ladder, then the fastest plan (a runner-up); at least
    `min_replicas` replicas."""
    fastest = ilp.solve_regimes(tables, configs, settings, use_all_devices, min_replicas)
    if not fastest:
        return []
    items = ilp.pareto_items(tables, configs)
    t_star_ns = round(fastest[0].objective_s * NS_PER_S)
    candidates = list(fastest)
    for factor in TIME_LADDER:
        for one_node in ilp.regimes(tables, use_all_devices):
            found = ilp.solve_regime(tables, configs, items, one_node, settings, use_all_devices,
                                      max_time_ns=math.ceil(t_star_ns * factor), min_replicas=min_replicas)
            if found is not None:
                candidates.append(found)
    best = min(candidates, key=lambda s: (cost_per_sample(tables, s), s.objective_s))
    return [best] + [s for s in fastest if s is not best][:1]
