"""`plan()`: the whole flow from a model file and a cluster spec to a Plan.

frontend (trace on meta) -> annotate -> blocks -> cost tables -> search -> assemble -> verify -> verify the
communication (passes.comm: every rank's stream proved free of deadlock, recorded in the plan's `comm`) ->
run each stage once on meta (passes.stage_check; what makes the run differ from one process: `warnings`) ->
the checkpoint's cost and interval (costmodel.checkpoint: `checkpoint`). For a model whose training state
outgrows every device, both checks run in a forked child that traced it at one row beside the first trace
(planner.checks_ahead), while the runners-up are ranked in another.

A cluster less lost devices (ClusterSpec.without) is planned like any other; the plan records the labels
it was made without (`inputs.lost_devices`). `plan replan` (planner.replanning, planner.cli.replan_cmd)
plans a previous plan's model and options again on what is left.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from costmodel import compression, compute, host_sharing
from costmodel.calibration import Calibration, load_calibration
from costmodel.checkpoint import checkpoint_advice
from costmodel.cost_notes import cost_notes
from costmodel.tables import CostTables, build_tables
from passes.annotate import Annotate, MetaShapes
from passes.base import PassManager
from passes.blocks import BLOCKS_KEY, Blocks
from passes.saved import SavedActivations
from passes.shardings import block_shardings
from passes.stage_check import check_batch_norm_rows, training_notes
from passes.verify import verify_plan
from planner import checks_ahead, dumps, frontend, own_processes, runners_up
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec
from planner.core.comm_records import CommRecord
from planner.core.errors import HetplanError, PlanningError
from planner.core.forked import Waiting, forked
from planner.core.frozen_heap import frozen_heap
from planner.core.ir import Plan, PlanInputs, SolverFacts
from planner.frontend.cluster import load_cluster
from planner.frontend.model_file import check_dataset
from planner.frontend.onnx_model import OnnxModel, is_onnx_file, load_onnx_model
from planner.options import PlanOptions, RunControls, check_options
from planner.search import baselines, strategies
from planner.search.configs import build_configs
from planner.search.options import SearchOptions

DEFAULT_TRACE_BATCH = 2


@dataclass
class PlanResult:
    plan: Plan
    graph: fx.GraphModule
    blocks: list[Block]
    tables: CostTables
    # per phase: load_s, trace_s, cost_s, search_s, comm_s, runners_up_s, total_s; runners_up_s is what the
    # runners-up took beyond the communication checks, which a forked child made them beside (core.forked)
    timings_s: dict[str, float]
    model_file: frontend.ModelFile | OnnxModel     # OnnxModel: a cost-only plan of an .onnx graph
    cluster: ClusterSpec
    pass_timings_s: dict[str, float] = field(default_factory=dict)   # per analysis pass, from its manager


@dataclass
class PhaseTimer:
    """Wall time per phase of planning, by name (`with timer.phase("trace_s"): ...`); `on_start` hears each
    phase's name as it starts (`runners_up_s` as "runners-up": RunControls.progress)."""

    timings_s: dict[str, float] = field(default_factory=dict)
    on_start: Callable[[str], None] | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.on_start is not None:
            self.on_start(name.removesuffix("_s").replace("_", "-"))
        start = time.perf_counter()
        yield
        self.timings_s[name] = time.perf_counter() - start


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def trace_model_file(model_file: frontend.ModelFile, trace_batch: int = DEFAULT_TRACE_BATCH,
                     max_blocks: int = 96) -> tuple[fx.GraphModule, list[Block], tuple[Any, ...]]:
    """Trace on meta and run the analysis passes; returns the graph, its blocks and the meta inputs."""
    gm, meta_inputs = _trace_on_meta(model_file, trace_batch)
    analyse(gm, meta_inputs, max_blocks)
    return gm, gm.meta[BLOCKS_KEY], meta_inputs


def _trace_on_meta(model_file: frontend.ModelFile | OnnxModel,
                   trace_batch: int) -> tuple[fx.GraphModule, tuple[Any, ...]]:
    if isinstance(model_file, OnnxModel):   # read, not traced: the ONNX file's graph at its own batch
        return model_file.graph, model_file.meta_inputs
    return frontend.trace_model(model_file, trace_batch)   # the model file's contract checked around the trace


def analyse(gm: fx.GraphModule, meta_inputs: tuple[Any, ...], max_blocks: int = 96,
            dump_dir: Path | None = None) -> PassManager:
    """Run the analysis passes (shapes, costs, blocks) on `gm`, writing the graph after each to
    `dump_dir` when given; returns the manager that ran them, which holds each pass's time."""
    manager = PassManager([MetaShapes(meta_inputs), Annotate(), SavedActivations(), Blocks(max_blocks)],
                          dump_dir=dump_dir)
    manager.run(gm)
    return manager


def compression_table(options: PlanOptions, gm: fx.GraphModule, blocks: list[Block],
                       spec: ClusterSpec) -> compression.CompressionTable:
    """The compression policies and what the cost model needs for them (parameter shapes)."""
    shapes = tuple((str(n.target), tuple(n.meta["val"].shape)) for n in gm.graph.nodes
                   if n.op == "get_attr" and hasattr(n.meta.get("val"), "shape"))
    return compression.CompressionTable(
        gradient_policy=options.compression, activation_policy=options.activation_compression,
        param_shapes=shapes, block_params=tuple(b.params for b in blocks),
        kernel_bandwidth_bytes_s=tuple(compression.kernel_bandwidth_bytes_s(g.device) for g in spec.nodes),
        kernel_launch_s=tuple(compute.op_overhead_s(g.device) for g in spec.nodes), optimizer=options.optimizer)


def cost_tables(options: PlanOptions, gm: fx.GraphModule, blocks: list[Block], spec: ClusterSpec,
                calibration: Calibration | None, trace_batch: int = DEFAULT_TRACE_BATCH) -> CostTables:
    """The cost tables the search reads: compute, memory and links per device class (costmodel.tables),
    the compression policies' costs, and what tensor parallelism splits per block (passes.tensor_parallel's
    pairs, priced per degree in the search)."""
    tables = build_tables(blocks, spec, global_batch=options.global_batch, trace_batch=trace_batch,
                          precision_policy=options.precision, memory_margin=options.memory_margin,
                          calibration=calibration)
    tables = compression.with_compression(tables, compression_table(options, gm, blocks, spec))
    return dataclasses.replace(tables, shardings=block_shardings(gm, blocks))


def _baselines(options: PlanOptions, controls: RunControls, tables: CostTables, blocks: list[Block],
               spec: ClusterSpec, inputs: PlanInputs) -> list[tuple[str, Plan]]:
    """Every baseline strategy's plan that fits (for the runners-up), unless one was asked for."""
    if options.strategy in baselines.SOLVERS or options.strategy in baselines.FIRST_TRIES:
        return []
    out = []
    for name in baselines.SOLVERS:
        try:
            out.append((name, baselines.run(name, tables=tables, blocks=blocks, spec=spec, inputs=inputs,
                                            options=options.search_options(controls))))
        except PlanningError:
            continue
    return out


def plan(model: str | Path, cluster: str | Path | ClusterSpec, options: PlanOptions | None = None,
         controls: RunControls | None = None) -> PlanResult:
    """Plan training of the model in file `model` on `cluster`; `controls` say how (time limits, what to
    dump for a person to read), never what. Raises HetplanError subclasses."""
    options = options or PlanOptions()
    controls = controls or RunControls()
    check_options(options)
    timer = PhaseTimer(on_start=controls.progress)
    start = time.perf_counter()
    with timer.phase("load_s"):
        spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
        # fail before tracing; CPU compute priced for the spec's processes per host
        calibration = host_sharing.for_spec(load_calibration(options.calibration), spec) if options.calibration \
            else None
        model_file = load_onnx_model(model, DEFAULT_TRACE_BATCH) if is_onnx_file(model) else \
            frontend.load_model_file(model, options.names, controls.trace_timeout_s)
    trace_batch = model_file.trace_batch if isinstance(model_file, OnnxModel) else DEFAULT_TRACE_BATCH
    with ExitStack() as stack:
        with timer.phase("trace_s"), frozen_heap():      # the collector skips the heap there is (core.frozen_heap)
            # a large model's one-row trace and the plan's checks, in a child that starts now (checks_ahead)
            ahead = stack.enter_context(checks_ahead.traced_ahead(model_file, spec, controls.fork_steps)) \
                if isinstance(model_file, frontend.ModelFile) else None
            gm, meta_inputs = _trace_on_meta(model_file, trace_batch)
            if isinstance(model_file, frontend.ModelFile):
                check_dataset(model_file, options.global_batch)   # dataset() holds one global batch
            passes = analyse(gm, meta_inputs, options.max_blocks, controls.dump_ir_dir)
        return _planned(options, controls, timer, start, spec, calibration, model_file, trace_batch, gm, passes,
                        ahead)


def _planned(options: PlanOptions, controls: RunControls, timer: PhaseTimer, start: float, spec: ClusterSpec,
             calibration: Calibration | None, model_file: frontend.ModelFile | OnnxModel, trace_batch: int,
             gm: fx.GraphModule, passes: PassManager,
             ahead: Waiting[fx.GraphModule, Plan, CommRecord] | None) -> PlanResult:
    """plan() from the traced model on: cost, search, the checks, the runners-up; `ahead`: the child
    that traced the model at one row and checks the plan (checks_ahead), where there is one."""
    blocks: list[Block] = gm.meta[BLOCKS_KEY]
    with timer.phase("cost_s"):
        tables = cost_tables(options, gm, blocks, spec, calibration, trace_batch)
    search_options = options.search_options(controls)
    if controls.dump_ir_dir is not None:
        _dump_problem(controls.dump_ir_dir, tables, search_options)

    cluster_path = Path(spec.source_path) if spec.source_path else None
    inputs = PlanInputs(
        model_path=str(model_file.path.resolve()), model_digest=model_file.digest,
        cluster_path=str(cluster_path.resolve()) if cluster_path else "",
        cluster_digest=file_digest(cluster_path) if cluster_path and cluster_path.is_file() else "",
        cluster_name=spec.name, options=options.as_pairs(), trace_batch=trace_batch,
        model_input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"),
        lost_devices=spec.lost)

    def search(on: ClusterSpec, costed: CostTables) -> tuple[Plan, list[tuple[str, Plan]]]:
        return strategies.run_with_alternatives(options.strategy, tables=costed, blocks=blocks, spec=on,
                                                inputs=inputs, options=search_options)

    with timer.phase("search_s"), frozen_heap():
        result, alternatives = search(spec, tables)
        # a CPU plan that leaves devices idle is planned again priced for the processes it runs
        priced = own_processes.priced_for_own(
            result, alternatives, spec, calibration, search=search,
            cost=lambda on, cal: cost_tables(options, gm, blocks, on, cal, trace_batch))
        result, alternatives, calibration = priced.plan, priced.alternatives, priced.calibration
    verify_plan(result, spec)

    searched = result

    def ranked() -> SolverFacts:
        """The searched plan's facts with its runners-up (every baseline, the first tries, each simulated):
        they need the tables, not the communication checks, which change neither the plan's layout nor its
        facts, so a forked child ranks them while this process checks (core.forked)."""
        with frozen_heap():
            first = runners_up.first_tries(tables=tables, blocks=blocks, spec=spec, inputs=inputs,
                                           options=search_options) if options.strategy in ("ilp", "exact") else None
            others = alternatives + _baselines(options, controls, tables, blocks, spec, inputs)
            return runners_up.with_runners_up(searched, others, spec, first).solver

    with forked(ranked, controls.fork_steps) if options.runners_up else nullcontext() as child:
        if isinstance(model_file, frontend.ModelFile):  # an .onnx graph is cost-only: no program communicates
            with timer.phase("comm_s"), frozen_heap():
                check_batch_norm_rows(result, gm, trace_batch, str(model_file.path))   # before a trace at that size
                if ahead is not None and checks_ahead.uses_ahead_rows(result):
                    ahead.send(result)
                    comm = ahead.result(checks_ahead.CHILD_WAIT_S)
                else:
                    if ahead is not None:
                        ahead.stop()
                    comm = checks_ahead.checked_comm(result, model_file, gm, trace_batch, controls.fork_steps)
                result = dataclasses.replace(result, comm=comm)
            result = dataclasses.replace(result, warnings=training_notes(result, gm))
        if child is not None:
            with timer.phase("runners_up_s"):     # what the checks left to wait for
                result = dataclasses.replace(result, solver=child.result(checks_ahead.CHILD_WAIT_S))
    result = dataclasses.replace(result, warnings=result.warnings + cost_notes(result, spec, calibration))
    result = dataclasses.replace(result, checkpoint=checkpoint_advice(result, spec))
    timings = {**timer.timings_s, "total_s": time.perf_counter() - start}
    return PlanResult(result, gm, blocks, tables, timings, model_file, spec, dict(passes.timings_s))


def _dump_problem(folder: Path, tables: CostTables, options: SearchOptions) -> None:
    """The costed problem, and the candidate configurations where the strategy builds them (`--dump-ir`)."""
    dumps.write_costed_problem(folder, tables, options)
    if options.strategy in ("ilp", "exact"):
        configs = build_configs(tables, options.stages, options.micro_batch, schedule=options.schedule)
        dumps.write_candidates(folder, tables, configs)


__all__ = ["plan", "PlanOptions", "PlanResult", "RunControls", "HetplanError"]
