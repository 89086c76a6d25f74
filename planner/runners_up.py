"""Why this plan: the other plans the search saw, simulated under the same model, and what made
them slower (`plan inspect` shows them).

The alternatives are the ILP's best plan of the other topology regime (replicas inside one node,
or spread over the network), every baseline strategy that fits (uniform, fastest, megatron,
metis), and always the two plans a user would try first (`first_tries`): the best plan on a single
device and the best pure data-parallel plan, free of the options that shape the chosen plan's
pipelines (--stages, --micro-batch, --use-all-devices, --schedule) and minimising time. Each is simulated
(backends.sim) as the chosen plan is, so they compare on one clock. A first try that is the chosen
plan is recorded as such (SAME_AS_CHOSEN, shown in the chosen row, not as a row of its own); one that
has no plan says why (NO_PLAN_DEVICES devices: "fits on no single device: needs X GiB ...").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from backends.report.text import NO_PLAN_DEVICES, SAME_AS_CHOSEN, layout, signed_time
from backends.sim import simulate_plan
from costmodel.tables import CostTables
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec
from planner.core.errors import PlanningError
from planner.core.ir import Plan, PlanInputs, RunnerUp
from planner.search import baselines
from planner.search.options import SearchOptions

# the first tries by strategy, and the name of each one's row
FIRST_TRY_ROWS = {"single": "single device", "dp": "data parallel"}


@dataclass
class FirstTries:
    """The plans a user would try first: planned (row name, plan), or why there is none (row name, why)."""

    planned: list[tuple[str, Plan]] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)


def first_tries(*, tables: CostTables, blocks: list[Block], spec: ClusterSpec, inputs: PlanInputs,
                options: SearchOptions) -> FirstTries:
    """The best single-device plan and the best pure data-parallel plan (baselines `single`, `dp`),
    whatever depth, micro-batch size, schedule or device count the chosen plan was held to."""
    free = dataclasses.replace(options, stages=None, micro_batch=None, use_all_devices=False, schedule="auto")
    out = FirstTries()
    for strategy, row in FIRST_TRY_ROWS.items():
        try:
            out.planned.append((row, baselines.run(strategy, tables=tables, blocks=blocks, spec=spec, inputs=inputs,
                                                   options=dataclasses.replace(free, strategy=strategy))))
        except PlanningError as exc:    # the row says why: "fits on no single device: needs 140.2 GiB ..."
            why = exc.message.partition("finds no plan: ")[2] or exc.message
            out.missing.append((row, why.removeprefix("the model ")))
    return out


def why_slower(chosen: Plan, chosen_sim_s: float, other: Plan, other_sim_s: float, outside: str = "") -> str:
    """The differences that make `other` slower (or say that it is not, in simulation); `outside`: the
    options of the chosen plan that `other` was not held to, named when `other` is faster."""
    ce, oe = chosen.estimates, other.estimates
    parts = []
    d_pipe, d_sync = oe.pipeline_s - ce.pipeline_s, oe.sync_s - ce.sync_s
    if abs(d_pipe) >= 0.01 * ce.iteration_s:
        parts.append(f"pipeline {signed_time(d_pipe)} (bubble {oe.bubble_fraction:.0%} vs {ce.bubble_fraction:.0%})")
    if abs(d_sync) >= 0.01 * ce.iteration_s:
        parts.append(f"gradient sync {signed_time(d_sync)}")
    if other.world_size != chosen.world_size:
        parts.append(f"{other.world_size} device{'s' if other.world_size != 1 else ''} vs {chosen.world_size}")
    detail = "; ".join(parts) if parts else "same estimate within 1%"
    ratio = other_sim_s / chosen_sim_s if chosen_sim_s > 0 else float("inf")
    if ratio < 1.0:
        held = f"; the chosen plan was held to {outside}" if outside else ""
        if oe.iteration_s < ce.iteration_s:
            return f"{1 / ratio:.2f}x faster ({detail}){held}"
        return (f"{1 / ratio:.2f}x faster in simulation although its estimate is "
                f"{oe.iteration_s / ce.iteration_s:.2f}x the chosen one's ({detail}){held}")
    return f"{ratio:.2f}x slower: {detail}"


def held_to(plan: Plan) -> str:
    """The options `plan` was made under that the first tries are free of, as flags ("" when none)."""
    asked = dict(plan.inputs.options)
    flags = [f"--stages {asked['stages']}" if asked.get("stages", "None") != "None" else "",
             f"--micro-batch {asked['micro_batch']}" if asked.get("micro_batch", "None") != "None" else "",
             "--use-all-devices" if asked.get("use_all_devices") == "True" else "",
             f"--schedule {asked['schedule']}" if asked.get("schedule", "auto") != "auto" else "",
             "--objective cost" if asked.get("objective") == "cost" else ""]    # the first tries minimise time
    return ", ".join(f for f in flags if f)


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same way: devices, stages, shares, micro-batches, schedules and
    compressors alike (estimates and the strategy that found them aside)."""
    def shape(p: Plan) -> tuple:
        replicas = tuple((r.node_group, r.batch_share, r.micro_batch_sizes, r.schedule,
                          tuple((st.device, st.first_block, st.last_block, st.recompute, st.precision)
                                for st in r.stages)) for r in p.replicas)
        return (replicas, tuple((g.ranks, g.params, g.compressor) for g in p.grad_groups),
                tuple((e.src_rank, e.dst_rank, e.compressor) for e in p.p2p))
    return shape(a) == shape(b)


def with_runners_up(plan: Plan, alternatives: list[tuple[str, Plan]], spec: ClusterSpec,
                    first: FirstTries | None = None) -> Plan:
    """`plan` with its simulated time and the alternatives ranked by simulated time in its facts (then the
    first tries that have no plan, each saying why)."""
    chosen_s = simulate_plan(plan, spec, timeline=False).iteration_s

    def runner_up(name: str, other: Plan, other_s: float, why: str) -> RunnerUp:
        return RunnerUp(name=name, estimated_iteration_s=other.estimates.iteration_s, simulated_iteration_s=other_s,
                        pipeline_s=other.estimates.pipeline_s, sync_s=other.estimates.sync_s,
                        devices_used=other.world_size, layout=layout(other), why_slower=why)

    ups = []
    for name, other in alternatives:
        other_s = simulate_plan(other, spec, timeline=False).iteration_s
        ups.append(runner_up(name, other, other_s, why_slower(plan, chosen_s, other, other_s)))
    first = first or FirstTries()
    outside = held_to(plan)
    for name, other in _merged(first.planned):
        if same_plan(plan, other):     # shown in the chosen row, not as a duplicate of it
            ups.append(runner_up(name, plan, chosen_s, SAME_AS_CHOSEN))
            continue
        other_s = simulate_plan(other, spec, timeline=False).iteration_s
        ups.append(runner_up(name, other, other_s, why_slower(plan, chosen_s, other, other_s, outside)))
    ups.sort(key=lambda u: (u.simulated_iteration_s, u.name))
    ups += [RunnerUp(name=name, estimated_iteration_s=0.0, simulated_iteration_s=0.0, pipeline_s=0.0, sync_s=0.0,
                     devices_used=NO_PLAN_DEVICES, layout="-", why_slower=why) for name, why in first.missing]
    facts = dataclasses.replace(plan.solver, runners_up=tuple(ups), simulated_iteration_s=chosen_s)
    return dataclasses.replace(plan, solver=facts)


def _merged(planned: list[tuple[str, Plan]]) -> list[tuple[str, Plan]]:
    """First tries that are the same plan as one before them are one entry under both names
    ("single device = data parallel": more replicas would cost more in gradient sync than they save)."""
    out: list[tuple[str, Plan]] = []
    for name, other in planned:
        same = next((i for i, (_, p) in enumerate(out) if same_plan(p, other)), None)
        if same is None:
            out.append((name, other))
        else:
            out[same] = (f"{out[same][0]} = {name}", out[same][1])
    return out
