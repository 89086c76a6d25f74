"""Search strategies by name. `ilp` is the planner; `exact` enumerates the ILP's space (small
clusters: a reference optimum); the others are baselines for comparison (planner.search.baselines):
the published recipes, and the two plans a user would try first (`single`, `dp`)."""

from __future__ import annotations

from costmodel.tables import CostTables
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec
from planner.core.errors import PlanningError
from planner.core.ir import Plan, PlanInputs
from planner.search import baselines, candidates, cost, explain, ilp
from planner.search.assemble import assemble
from planner.search.configs import build_configs
from planner.search.enumerate import exact_solution
from planner.search.options import SearchOptions

STRATEGIES = ("ilp", "exact", *baselines.SOLVERS, *baselines.FIRST_TRIES)


def run(name: str, *, tables: CostTables, blocks: list[Block], spec: ClusterSpec, inputs: PlanInputs,
        options: SearchOptions) -> Plan:
    return run_with_alternatives(name, tables=tables, blocks=blocks, spec=spec, inputs=inputs, options=options)[0]


def run_with_alternatives(name: str, *, tables: CostTables, blocks: list[Block], spec: ClusterSpec,
                          inputs: PlanInputs, options: SearchOptions) -> tuple[Plan, list[tuple[str, Plan]]]:
    """The strategy's plan, and the other topology regime's best plan where the ILP found one."""
    if name not in STRATEGIES:
        raise PlanningError(f"unknown strategy `{name}`", field="--strategy",
                            fix=f"use one of: {', '.join(STRATEGIES)}")
    if name in baselines.SOLVERS or name in baselines.FIRST_TRIES:
        return baselines.run(name, tables=tables, blocks=blocks, spec=spec, inputs=inputs, options=options), []
    configs = build_configs(tables, options.stages, options.micro_batch, schedule=options.schedule)
    if not configs:
        raise PlanningError(explain.nothing_fits(tables, options.stages), file=str(inputs.model_path),
                            fix=explain.what_would_fit(tables))
    if name == "exact":   # enumeration of the ILP's space: small clusters only
        exact = exact_solution(tables, configs, use_all_devices=options.use_all_devices)
        solutions = [exact] if exact else []
    elif options.objective == "cost":
        cost.check_prices(tables, spec.source_path)
        solutions = cost.solve_cost(tables, configs, options.solver, use_all_devices=options.use_all_devices)
    else:
        solutions = ilp.solve_regimes(tables, configs, options.solver, use_all_devices=options.use_all_devices)
    if not solutions:
        raise PlanningError("the solver found no plan within its time limit", fix="raise --time-limit")
    plans = [assemble(solution=s, tables=tables, blocks=blocks, spec=spec, inputs=inputs, strategy=name)
             for s in solutions]
    def label(s: candidates.Solution) -> str:
        if options.objective == "cost":
            return f"{name} fastest"
        return f"{name} {'one-node' if s.one_node else 'spread'}"
    return plans[0], [(label(s), p) for s, p in zip(solutions[1:], plans[1:])]
