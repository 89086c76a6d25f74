"""CP-SAT settings of the planner's model: its defaults against the project's (planner.search.solver).

    python benchmarks/solver_settings.py            # plan_quality's cases + Llama-70B on 1024 GPUs
    python benchmarks/solver_settings.py --quick    # gpt and resnet only

Every case (model x cluster at plan_quality's global batch, and plan_time's 1024-GPU Llama-70B) is
solved twice in this process, once with CP-SAT's presolve rounds and probing level and once with the
project's (`solver.PRESOLVE_ITERATIONS`, `solver.PROBING_LEVEL`), alternating per case so that changes of the
machine's speed hit both alike. Both must reach the same objective with the same status: the settings
may change how fast the optimum is proven, never which one it is. Prints the table and writes
benchmarks/results/solver_settings.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HETPLAN_SEQ_LEN", "1024")   # as plan_quality: read when llama7b is imported

import common  # noqa: E402
import plan_time  # noqa: E402

from costmodel.tables import CostTables, build_tables  # noqa: E402
from planner.api import DEFAULT_TRACE_BATCH  # noqa: E402
from planner.frontend.cluster import load_cluster  # noqa: E402
from planner.search import ilp, solver  # noqa: E402
from planner.search.configs import build_configs  # noqa: E402, solver

MODELS = ("gpt", "llama7b", "resnet")
QUICK_MODELS = ("gpt", "resnet")
SETTINGS = {"cp-sat defaults": (3, 2), "project": (solver.PRESOLVE_ITERATIONS, solver.PROBING_LEVEL)}
LARGE_GPUS = 1024


def solve_timed(tables: CostTables, presolve_iterations: int, probing_level: int) -> dict[str, Any]:
    """Configurations and the CP-SAT solve (both regimes) under the given settings: seconds, objective, status."""
    settings = solver.SolverSettings(presolve_iterations=presolve_iterations, probing_level=probing_level)
    configs = build_configs(tables)
    start = time.perf_counter()
    found = ilp.solve(tables, configs, settings) if configs else None
    return {"solve_s": time.perf_counter() - start, "objective_s": found.objective_s if found else None,
            "status": found.status if found else "no plan"}


def cases(models: tuple[str, ...], large: bool) -> list[tuple[str, CostTables]]:
    out = []
    for name in models:
        model = common.trace(name)
        for path in common.cluster_files():
            spec = load_cluster(path)
            batch = max(64, spec.num_devices)       # plan_quality's global batch
            out.append((f"{name}/{path.stem}", build_tables(model.blocks, spec, global_batch=batch,
                                                            trace_batch=DEFAULT_TRACE_BATCH)))
    if large:
        model = common.trace("llama70b")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "cluster.yaml"
            path.write_text(plan_time.cluster_yaml(LARGE_GPUS))
            spec = load_cluster(path)
        out.append((f"llama70b/gen-{LARGE_GPUS}", build_tables(model.blocks, spec, global_batch=LARGE_GPUS,
                                                              trace_batch=DEFAULT_TRACE_BATCH)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt and resnet only, no Llama-70B")
    args = parser.parse_args()
    rows, records, mismatches = [], [], 0
    for label, tables in cases(QUICK_MODELS if args.quick else MODELS, not args.quick):
        results = {name: solve_timed(tables, *values) for name, values in SETTINGS.items()}
        default, tuned = results["cp-sat defaults"], results["project"]
        same = (default["status"], default["objective_s"]) == (tuned["status"], tuned["objective_s"])
        mismatches += not same
        rows.append([label, f"{default['solve_s']:.2f}", f"{tuned['solve_s']:.2f}",
                     f"{default['solve_s'] / max(tuned['solve_s'], 1e-9):.1f}x", tuned["status"],
                     "yes" if same else "NO"])
        records.append({"case": label, "same_objective": same, **results})
    print(common.table(["case", "defaults s", "project s", "speed-up", "status", "same optimum"], rows))
    totals = {name: sum(r[name]["solve_s"] for r in records) for name in SETTINGS}
    print(f"\ntotal: CP-SAT defaults {totals['cp-sat defaults']:.1f} s, project {totals['project']:.1f} s; "
          f"{mismatches} case(s) with a different optimum")
    out = common.write_json("solver_settings", {
        "settings": {k: {"max_presolve_iterations": v[0], "cp_model_probing_level": v[1]} for k, v in SETTINGS.items()},
        "machine": platform.platform(), "cpus": os.cpu_count(), "total_solve_s": totals,
        "cases": records})
    print(f"wrote {out}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
