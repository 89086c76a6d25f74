"""`plan()`: the whole flow from a model file and a cluster spec to a Plan.

frontend (trace on meta) -> annotate -> blocks -> cost tables -> search -> assemble -> verify.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.fx as fx

from costmodel import compression, compute
from costmodel.calibration import load_calibration
from costmodel.tables import CostTables, build_tables
from passes.annotate import Annotate, MetaShapes
from passes.base import PassManager
from passes.blocks import BLOCKS_KEY, Blocks
from passes.verify import verify_plan
from planner import frontend, runners_up
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec
from planner.core.errors import HetplanError, PlanningError
from planner.core.ir import Plan, PlanInputs
from planner.frontend.cluster import load_cluster
from planner.options import PlanOptions, RunControls, check_options
from planner.search import baselines, strategies

DEFAULT_TRACE_BATCH = 2


@dataclass
class PlanResult:
    plan: Plan
    graph: fx.GraphModule
    blocks: list[Block]
    tables: CostTables
    timings_s: dict[str, float]
    model_file: frontend.ModelFile
    cluster: ClusterSpec


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def trace_model_file(model_file: frontend.ModelFile, trace_batch: int = DEFAULT_TRACE_BATCH,
                     max_blocks: int = 96) -> tuple[fx.GraphModule, list[Block], tuple[Any, ...]]:
    """Trace on meta and run the analysis passes; returns the graph, its blocks and the meta inputs."""
    module = frontend.build_on_meta(model_file)
    inputs, _ = frontend.example_batch(model_file, trace_batch)
    meta_inputs = frontend.to_device(inputs, "meta")
    gm = frontend.trace(module, meta_inputs, file=str(model_file.path), replicate_repeated=True)
    PassManager([MetaShapes(meta_inputs), Annotate(), Blocks(max_blocks)]).run(gm)
    return gm, gm.meta[BLOCKS_KEY], meta_inputs


def _compression_table(options: PlanOptions, gm: fx.GraphModule, blocks: list[Block],
                       spec: ClusterSpec) -> compression.CompressionTable:
    """The compression policies and what the cost model needs for them (parameter shapes)."""
    shapes = tuple((str(n.target), tuple(n.meta["val"].shape)) for n in gm.graph.nodes
                   if n.op == "get_attr" and hasattr(n.meta.get("val"), "shape"))
    return compression.CompressionTable(
        gradient_policy=options.compression, activation_policy=options.activation_compression,
        param_shapes=shapes, block_params=tuple(b.params for b in blocks),
        kernel_bandwidth_bytes_s=tuple(compression.kernel_bandwidth_bytes_s(g.device) for g in spec.nodes),
        kernel_launch_s=tuple(compute.op_overhead_s(g.device) for g in spec.nodes), optimizer=options.optimizer)


def _baselines(options: PlanOptions, controls: RunControls, tables: CostTables, blocks: list[Block],
               spec: ClusterSpec, inputs: PlanInputs) -> list[tuple[str, Plan]]:
    """Every baseline strategy's plan that fits (for the runners-up), unless one was asked for."""
    if options.strategy in baselines.SOLVERS:
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
    timings: dict[str, float] = {}
    start = time.perf_counter()
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    calibration = load_calibration(options.calibration) if options.calibration else None  # fail before tracing
    model_file = frontend.load_model_file(model, options.names)
    timings["load_s"] = time.perf_counter() - start

    t0 = time.perf_counter()
    gm, blocks, _ = trace_model_file(model_file, DEFAULT_TRACE_BATCH, options.max_blocks)
    timings["trace_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tables = build_tables(blocks, spec, global_batch=options.global_batch, trace_batch=DEFAULT_TRACE_BATCH,
                          precision_policy=options.precision, memory_margin=options.memory_margin,
                          calibration=calibration)
    tables = compression.with_compression(tables, _compression_table(options, gm, blocks, spec))
    timings["cost_s"] = time.perf_counter() - t0

    cluster_path = Path(spec.source_path) if spec.source_path else None
    inputs = PlanInputs(
        model_path=str(Path(model).resolve()), model_digest=model_file.digest,
        cluster_path=str(cluster_path.resolve()) if cluster_path else "",
        cluster_digest=_digest(cluster_path) if cluster_path and cluster_path.is_file() else "",
        cluster_name=spec.name, options=options.as_pairs(), trace_batch=DEFAULT_TRACE_BATCH,
        model_input_names=tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"))

    t0 = time.perf_counter()
    result, alternatives = strategies.run_with_alternatives(options.strategy, tables=tables, blocks=blocks,
                                                            spec=spec, inputs=inputs,
                                                            options=options.search_options(controls))
    timings["search_s"] = time.perf_counter() - t0
    verify_plan(result, spec)
    if options.runners_up:
        t0 = time.perf_counter()
        others = alternatives + _baselines(options, controls, tables, blocks, spec, inputs)
        result = runners_up.with_runners_up(result, others, spec)
        timings["runners_up_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - start
    return PlanResult(result, gm, blocks, tables, timings, model_file, spec)


__all__ = ["plan", "PlanOptions", "PlanResult", "RunControls", "HetplanError"]
