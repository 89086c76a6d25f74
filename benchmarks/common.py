"""Shared by the planning benchmarks: trace a model once, plan it on many clusters with any strategy,
simulate the plans, print tables, write JSON results."""

from __future__ import annotations

import dataclasses
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # runnable as `python benchmarks/<name>.py` from anywhere
    sys.path.insert(0, str(REPO))

from costmodel.tables import CostTables, build_tables  # noqa: E402
from passes.shardings import block_shardings  # noqa: E402
from passes.verify import verify_plan  # noqa: E402
from planner import frontend  # noqa: E402
from planner.api import DEFAULT_TRACE_BATCH, PlanOptions, trace_model_file  # noqa: E402
from planner.core.blocks import Block, BlockSharding  # noqa: E402
from planner.core.cluster import ClusterSpec  # noqa: E402
from planner.core.errors import PlanningError  # noqa: E402
from planner.core.ir import Plan, PlanInputs  # noqa: E402
from planner.search import degrees, explain, strategies  # noqa: E402
from planner.search.assemble import assemble  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
EXAMPLES = REPO / "examples"
SHARED_CLUSTERS = REPO.parent / "shared" / "clusters"
BYTES_PER_KIB = 1024


@dataclass(frozen=True)
class TracedModel:
    name: str
    path: Path
    blocks: list[Block]
    input_names: tuple[str, ...]
    digest: str
    trace_s: float
    shardings: tuple[BlockSharding, ...] = ()    # what tensor parallelism splits per block (passes.shardings)


def cluster_files() -> list[Path]:
    """Every spec in ../shared/clusters (falls back to the bundled examples/clusters)."""
    folder = SHARED_CLUSTERS if SHARED_CLUSTERS.is_dir() else EXAMPLES / "clusters"
    return sorted(folder.glob("*.yaml"))


def trace(name: str, max_blocks: int = 96) -> TracedModel:
    """Trace examples/<name>/model.py on meta once; its blocks serve every cluster."""
    path = EXAMPLES / name / "model.py"
    t0 = time.perf_counter()
    model_file = frontend.load_model_file(path, {})
    gm, blocks, _ = trace_model_file(model_file, DEFAULT_TRACE_BATCH, max_blocks)
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    return TracedModel(name, path, blocks, names, model_file.digest, time.perf_counter() - t0,
                       block_shardings(gm, blocks))


def _inputs(model: TracedModel, spec: ClusterSpec, options: PlanOptions) -> PlanInputs:
    return PlanInputs(model_path=str(model.path), model_digest=model.digest, cluster_path=spec.source_path,
                      cluster_digest="", cluster_name=spec.name, options=options.as_pairs(),
                      trace_batch=DEFAULT_TRACE_BATCH, model_input_names=model.input_names)


def model_tables(model: TracedModel, spec: ClusterSpec, options: PlanOptions) -> CostTables:
    """The cost tables with the model's shardings (as planner.api.plan builds them, compression aside)."""
    tables = build_tables(model.blocks, spec, global_batch=options.global_batch, trace_batch=DEFAULT_TRACE_BATCH,
                          precision_policy=options.precision, memory_margin=options.memory_margin)
    return dataclasses.replace(tables, shardings=model.shardings)


def plan_with(model: TracedModel, spec: ClusterSpec, options: PlanOptions) -> tuple[Plan, CostTables]:
    """Cost tables + search + verify for a traced model (what planner.api.plan does after the trace); the
    tables returned are the chosen plan's (at its tensor-parallel degree and ZeRO group, for the ILP)."""
    tables = model_tables(model, spec, options)
    plan = strategies.run(options.strategy, tables=tables, blocks=model.blocks, spec=spec,
                          inputs=_inputs(model, spec, options), options=options.search_options())
    verify_plan(plan, spec)
    return plan, tables


def plan_ilp_phases(model: TracedModel, spec: ClusterSpec, options: PlanOptions,
                    ) -> tuple[Plan, dict[str, float], list[dict[str, float | int | str]]]:
    """The `ilp` strategy's steps one by one (as strategies.run: the degree search of
    planner.search.degrees), each timed: cost tables, candidate configurations and CP-SAT (summed over
    the variants, and per variant), assemble, verify. Raises PlanningError as `plan` does."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    tables = model_tables(model, spec, options)
    search = options.search_options()
    times["tables_s"] = time.perf_counter() - t0
    found, per_variant = degrees.search(tables, search)
    times["configs_s"] = sum(float(v["configs_s"]) for v in per_variant)
    times["solve_s"] = sum(float(v["solve_s"]) for v in per_variant)
    if not found:
        if not any(v["configurations"] for v in per_variant):
            raise PlanningError(explain.nothing_fits(tables, options.stages), fix=explain.what_would_fit(tables))
        raise PlanningError("the solver found no plan within its time limit", fix="raise --time-limit")
    solution, variant = found[0]
    t0 = time.perf_counter()
    plan = assemble(solution=solution, tables=variant.tables, blocks=model.blocks, spec=spec,
                    inputs=_inputs(model, spec, options), strategy="ilp")
    times["assemble_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    verify_plan(plan, spec)
    times["verify_s"] = time.perf_counter() - t0
    return plan, times, per_variant


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * BYTES_PER_KIB


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_json_to(path: Path, data: object) -> Path:
    """`data` as indented JSON at `path`, through a temporary sibling and a rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def write_json(name: str, data: object) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return out
