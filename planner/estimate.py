"""`estimate()`: how fast, and whether it fits, a layout the user wrote (planner.frontend.layout) would be.

The flow is `plan()`'s (planner.api) with the search replaced by the layout: load, trace, cost (at the
layout's options), build the layout into the search's records (planner.search.given), the one
`assemble()`, then the event simulation (backends.sim). A layout that fits is verified as every plan is
(passes.verify, the communication streams of passes.comm, each stage once on meta) and gets the
checkpoint advice, so it can be written and run like any plan; one that does not fit is returned with
the ranks that are over (`EstimateResult.overs`) and is never verified or written.

What the layout does not say comes from the command's options (PlanOptions, as `plan` takes them); where
both say it they must agree (`merge_options`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.fx as fx

from backends.sim import SimResult, simulate_plan
from costmodel import host_sharing
from costmodel.calibration import Calibration, load_calibration
from costmodel.checkpoint import checkpoint_advice
from costmodel.cost_notes import cost_notes
from costmodel.tables import CostTables
from passes.blocks import BLOCKS_KEY
from passes.comm import verify_comm
from passes.comm.inputs import trace_splits, traced_inputs
from passes.stage_check import check_batch_norm_rows, check_plan_stages, training_notes
from passes.verify import verify_plan
from planner import api, frontend
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec
from planner.core.errors import OptionError, PlanningError
from planner.core.ir import Plan, PlanInputs
from planner.frontend.cluster import load_cluster
from planner.frontend.layout import Layout
from planner.frontend.model_file import check_dataset
from planner.options import PlanOptions, RunControls
from planner.search import given
from planner.search.assemble import assemble

STRATEGY = "layout"       # the plan's solver facts and options name it: the user's layout, not a search


@dataclass
class EstimateResult:
    plan: Plan
    simulation: SimResult
    overs: list[given.Over]           # ranks over their device's memory (empty: the layout fits)
    result: api.PlanResult            # what `write_plan_dir` reads (timings, the model file)
    layout: Layout                    # the layout estimated, the shorthand's replicas spelled out

    @property
    def fits(self) -> bool:
        return not self.overs


def merge_options(layout: Layout, options: PlanOptions, given_flags: set[str]) -> PlanOptions:
    """`options` with what the layout says; OptionError where a flag the user gave (`given_flags`: field
    names of PlanOptions) says otherwise."""
    said: dict[str, Any] = {"global_batch": layout.global_batch or (layout.shorthand.gbs if layout.shorthand else None),
            "compression": layout.compression, "activation_compression": layout.activation_compression,
            "precision": layout.precision, "memory_margin": layout.memory_margin}
    out = options
    for name, value in said.items():
        if value is None:
            continue
        if name in given_flags and getattr(options, name) != value:
            flag = "--" + name.replace("_", "-")
            raise OptionError(f"the layout says {name} {value}, {flag} says {getattr(options, name)}",
                              file=layout.source, field=flag, fix=f"drop {flag}, or make the two agree")
        out = dataclasses.replace(out, **{name: value})
    tp = {r.tp for r in layout.replicas} or ({layout.shorthand.tp} if layout.shorthand else set())
    return dataclasses.replace(out, strategy=STRATEGY, runners_up=False, zero="on" if layout.zero else "off",
                               tp=next(iter(tp)) if len(tp) == 1 else None)


@dataclass
class Prepared:
    """The model traced and costed at the layout's options: what building a layout reads."""

    spec: ClusterSpec
    model_file: frontend.ModelFile
    gm: fx.GraphModule
    blocks: list[Block]
    tables: CostTables
    timer: api.PhaseTimer
    pass_timings_s: dict[str, float]
    calibration: Calibration | None = None     # as the tables were costed with (host_sharing.for_spec)


def prepare(model: str | Path, cluster: str | Path | ClusterSpec, options: PlanOptions,
            controls: RunControls | None = None) -> Prepared:
    """Load, trace and cost as `plan()` does (planner.api), at `options` (merge_options' result)."""
    controls = controls or RunControls()
    timer = api.PhaseTimer(on_start=controls.progress)
    with timer.phase("load_s"):
        spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
        # CPU compute priced for the spec's processes per host, as plan() does
        calibration = host_sharing.for_spec(load_calibration(options.calibration), spec) if options.calibration \
            else None
        model_file = frontend.load_model_file(model, options.names, controls.trace_timeout_s)
    with timer.phase("trace_s"):
        gm, meta_inputs = frontend.trace_model(model_file, api.DEFAULT_TRACE_BATCH)
        check_dataset(model_file, options.global_batch)
        passes = api.analyse(gm, meta_inputs, options.max_blocks)
    blocks = gm.meta[BLOCKS_KEY]
    with timer.phase("cost_s"):
        tables = api.cost_tables(options, gm, blocks, spec, calibration)
    return Prepared(spec, model_file, gm, blocks, tables, timer, dict(passes.timings_s), calibration)


def estimate(model: str | Path, cluster: str | Path | ClusterSpec, layout: Layout, options: PlanOptions,
             controls: RunControls | None = None) -> EstimateResult:
    """The plan of `layout` for the model in file `model` on `cluster`, estimated and simulated."""
    return estimate_prepared(prepare(model, cluster, options, controls), layout, options)


def estimate_prepared(prepared: Prepared, layout: Layout, options: PlanOptions) -> EstimateResult:
    """`estimate` on a model already traced and costed at `options` (`prepare`)."""
    p, timer = prepared, prepared.timer
    inputs = _inputs(p.model_file.path, p.model_file.digest, p.spec, options, p.gm)
    with timer.phase("search_s"):
        built, planned = _build(p, p.tables, layout, inputs)
        runs = host_sharing.plan_host_processes(planned, p.spec, p.calibration) if p.calibration else 0
        if p.calibration is not None and p.calibration.kind == "cpu" and runs != p.calibration.priced_processes:
            # CPU compute priced for the processes this layout runs on the host, not the spec's
            p = dataclasses.replace(p, calibration=host_sharing.priced_for(p.calibration, runs))
            built, planned = _build(p, api.cost_tables(options, p.gm, p.blocks, p.spec, p.calibration), layout, inputs)
    overs = given.overs(planned)
    try:
        verify_plan(planned, p.spec)     # every invariant; memory, checked last, is what `overs` reports
    except PlanningError:
        if not overs:
            raise
    if not overs:
        with timer.phase("comm_s"):
            check_batch_norm_rows(planned, p.gm, api.DEFAULT_TRACE_BATCH, str(p.model_file.path))
            splits = trace_splits(planned, p.model_file, p.gm, api.DEFAULT_TRACE_BATCH)
            planned = dataclasses.replace(planned, comm=verify_comm(planned, traced_inputs(planned, splits, p.gm)))
            check_plan_stages(splits, p.model_file)
        planned = dataclasses.replace(planned, warnings=training_notes(planned, p.gm)
                                      + cost_notes(planned, p.spec, p.calibration),
                                      checkpoint=checkpoint_advice(planned, p.spec))
    simulation = simulate_plan(planned, p.spec)
    planned = dataclasses.replace(planned, solver=dataclasses.replace(
        planned.solver, simulated_iteration_s=simulation.iteration_s))
    result = api.PlanResult(planned, p.gm, p.blocks, built.tables, dict(timer.timings_s), p.model_file, p.spec,
                            p.pass_timings_s)
    spelled = dataclasses.replace(layout, replicas=built.replicas, shorthand=None,
                                  global_batch=options.global_batch, compression=options.compression,
                                  activation_compression=options.activation_compression,
                                  precision=options.precision, memory_margin=options.memory_margin)
    return EstimateResult(planned, simulation, overs, result, spelled)


def _build(p: Prepared, tables: CostTables, layout: Layout, inputs: PlanInputs) -> tuple[given.Given, Plan]:
    """The layout built into the search's records with `tables`, and assembled into a plan."""
    built = given.build(layout, tables, p.blocks)
    try:
        return built, assemble(solution=built.solution, tables=built.tables, blocks=p.blocks, spec=p.spec,
                               inputs=inputs, strategy=STRATEGY)
    except PlanningError as exc:
        raise PlanningError(f"the layout's pipelines cannot be placed on the nodes: {exc.message}",
                            file=layout.source, field="replicas.devices",
                            fix="give each replica at most one node's devices, or whole nodes") from exc


def _inputs(model: str | Path, digest: str, spec: ClusterSpec, options: PlanOptions, gm: fx.GraphModule) -> PlanInputs:
    cluster_path = Path(spec.source_path) if spec.source_path else None
    return PlanInputs(
        model_path=str(Path(model).resolve()), model_digest=digest,
        cluster_path=str(cluster_path.resolve()) if cluster_path else "",
        cluster_digest=api.file_digest(cluster_path) if cluster_path and cluster_path.is_file() else "",
        cluster_name=spec.name, options=options.as_pairs(), trace_batch=api.DEFAULT_TRACE_BATCH,
        model_input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"), lost_devices=spec.lost)
