"""Plan quality: simulated throughput of the ILP's plan against every baseline strategy.

    python benchmarks/plan_quality.py            # gpt, llama7b, resnet on every cluster
    python benchmarks/plan_quality.py --quick    # gpt and resnet, global batch 64
    python benchmarks/plan_quality.py --plans-dir DIR   # also write every case's plan.json there

Each model is traced once on meta tensors (llama7b with HETPLAN_SEQ_LEN=1024 unless set, to keep
the trace short); each cluster in ../shared/clusters (else examples/clusters) is planned with
`ilp` and the baselines (uniform, fastest, megatron, metis), and every plan is run through the
event simulator (backends/sim). The table shows the ILP's simulated throughput and, per baseline,
ILP throughput / baseline throughput (> 1: the ILP is faster); `no fit` where a baseline finds no
plan. Writes benchmarks/results/plan_quality.json.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HETPLAN_SEQ_LEN", "1024")   # read when examples/llama7b/model.py is imported

import common  # noqa: E402

from backends.sim import simulate_plan  # noqa: E402
from planner.api import PlanOptions  # noqa: E402
from planner.core.cluster import ClusterSpec  # noqa: E402
from planner.core.errors import PlanningError  # noqa: E402
from planner.frontend.cluster import load_cluster  # noqa: E402
from planner.search.baselines import SOLVERS  # noqa: E402

MODELS = ("gpt", "llama7b", "resnet")
QUICK_MODELS = ("gpt", "resnet")
STRATEGIES = ("ilp", *SOLVERS)
GLOBAL_BATCH = 64
SAMPLES_PER_DEVICE = 1        # larger clusters get a larger batch: max(GLOBAL_BATCH, devices)


def evaluate(model: common.TracedModel, spec: ClusterSpec, strategy: str, batch: int,
             plan_path: Path | None = None) -> dict[str, Any]:
    """Plan with one strategy and simulate it; the error instead when it finds no plan. With
    `plan_path`, the plan is written there (to compare plans across versions byte for byte)."""
    t0 = time.perf_counter()
    try:
        plan, _ = common.plan_with(model, spec, PlanOptions(global_batch=batch, strategy=strategy))
    except PlanningError as exc:
        return {"strategy": strategy, "fits": False, "error": exc.one_line()}
    plan_s = time.perf_counter() - t0
    if plan_path is not None:
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(plan_path)
    sim = simulate_plan(plan, spec)
    return {"strategy": strategy, "fits": True, "plan_s": plan_s,
            "estimated_iteration_s": plan.estimates.iteration_s, "simulated_iteration_s": sim.iteration_s,
            "simulated_throughput_samples_s": sim.throughput_samples_s,
            "simulated_bubble_fraction": sim.bubble_fraction, "devices_used": plan.world_size,
            "layout": sorted(f"{r.node_group}:{len(r.stages)}st:{r.batch_share}" for r in plan.replicas)}


def row(cluster: str, batch: int, results: dict[str, dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    ilp = results["ilp"]
    if not ilp["fits"]:
        return [cluster, str(batch), "no plan", "-"] + ["-"] * len(SOLVERS) + ["-"], {"ilp_fits": False}
    tput = ilp["simulated_throughput_samples_s"]
    cells, ratios = [], {}
    for name in SOLVERS:
        r = results[name]
        if r["fits"]:
            ratios[name] = tput / r["simulated_throughput_samples_s"]
            cells.append(f"{ratios[name]:.2f}x")
        else:
            cells.append("no fit")
    best = min(ratios.values()) if ratios else None
    verdict = "-" if best is None else ("ok" if best >= 1.0 - 1e-9 else "ILP LOSES")
    est_vs_sim = ilp["estimated_iteration_s"] / ilp["simulated_iteration_s"]
    shown = f"{tput:,.0f}" if tput >= 10 else f"{tput:.2g}"     # a few samples/s keep their digits
    return ([cluster, str(batch), shown, f"{est_vs_sim:.3f}", *cells, verdict],
            {"ilp_fits": True, "ratio_vs": ratios, "ilp_vs_best_baseline": best})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt and resnet only, global batch 64")
    parser.add_argument("--plans-dir", type=Path, default=None,
                        help="write each case's plan.json as DIR/<model>/<cluster>/<strategy>.json")
    args = parser.parse_args()
    models = QUICK_MODELS if args.quick else MODELS
    clusters = [(path.stem, load_cluster(path)) for path in common.cluster_files()]
    report: dict[str, Any] = {"seq_len_llama": os.environ["HETPLAN_SEQ_LEN"], "models": {}}
    for name in models:
        model = common.trace(name)
        print(f"\n== examples/{name}: {len(model.blocks)} blocks, traced in {model.trace_s:.1f} s")
        rows, per_cluster = [], {}
        for cluster, spec in clusters:
            batch = GLOBAL_BATCH if args.quick else max(GLOBAL_BATCH, spec.num_devices * SAMPLES_PER_DEVICE)
            folder = args.plans_dir / name / cluster if args.plans_dir else None
            results = {s: evaluate(model, spec, s, batch, folder / f"{s}.json" if folder else None)
                       for s in STRATEGIES}
            cells, summary = row(cluster, batch, results)
            rows.append(cells)
            per_cluster[cluster] = {"global_batch": batch, "results": results, **summary}
        print(common.table(["cluster", "batch", "ilp samples/s", "est/sim", *(f"vs {s}" for s in SOLVERS),
                            "ilp >= best"], rows))
        report["models"][name] = {"blocks": len(model.blocks), "trace_s": model.trace_s, "clusters": per_cluster}
    print("\nvs X: simulated ILP throughput / simulated X throughput; est/sim: the ILP plan's own "
          "estimate of its iteration time over the simulated one")
    out = common.write_json("plan_quality", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
