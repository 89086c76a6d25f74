"""Search strategies by name. `ilp` is the planner; `exact` enumerates the ILP's space (small
clusters: a reference optimum); the others are baselines for comparison (planner.search.baselines):
the published recipes, and the two plans a user would try first (`single`, `dp`)."""

from __future__ import annotations

from costmodel.tables import CostTables
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec
from planner.core.errors import PlanningError
from planner.core.ir import Plan, PlanInputs
from planner.search import baselines, candidates, cost, degrees, explain
from planner.search.assemble import assemble
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
    if options.objective == "cost":
        cost.check_prices(tables, spec.source_path)
    found = degrees.best(tables, options)
    if not found:
        if not degrees.variants(tables, options):
            raise PlanningError(explain.nothing_fits(tables, options.stages), file=str(inputs.model_path),
                                fix=explain.what_would_fit(tables))
        raise PlanningError("the solver found no plan within its time limit", fix="raise --time-limit")
    top = found[0][1]
    # the chosen variant's other regime, and the best plan of another variant (as runners-up)
    kept = [sv for sv in found if sv[1] is top][:1 if name == "exact" else 2]
    kept += [sv for sv in found if sv[1] is not top][:1]
    plans = [assemble(solution=s, tables=v.tables, blocks=blocks, spec=spec, inputs=inputs, strategy=name)
             for s, v in kept]

    def label(s: candidates.Solution, v: degrees.Variant) -> str:
        what = "fastest" if options.objective == "cost" else ("one-node" if s.one_node else "spread")
        return f"{name} {what}" + (f" tp{v.tp_degree}" if v.tp_degree > 1 else "") + \
            (f" zero{v.zero_group}" if v.zero_group > 1 else "")
    return plans[0], [(label(s, v), p) for (s, v), p in zip(kept[1:], plans[1:])]
