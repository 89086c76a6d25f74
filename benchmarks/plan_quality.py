"""Plan quality: simulated throughput of the ILP's plan against every baseline strategy.

    python benchmarks/plan_quality.py            # gpt, llama7b, resnet on every cluster
    python benchmarks/plan_quality.py --quick    # gpt and resnet, global batch 64
    python benchmarks/plan_quality.py --plans-dir DIR   # also write every case's plan.json there
    python benchmarks/plan_quality.py --large-only      # the Llama-2-70B case alone (JSON: that case only)

Each model is traced once on meta tensors (llama7b with HETPLAN_SEQ_LEN=1024 unless set, to keep
the trace short); each cluster in ../shared/clusters (else examples/clusters) is planned with
`ilp` (its degree search: tensor-parallel degree x ZeRO, planner.search.degrees) and the baselines
(uniform, fastest, megatron and metis, the last two with tensor parallelism as their recipes choose
it), and every plan is run through the event simulator (backends/sim). The table shows the ILP's
simulated throughput, its TP degree and ZeRO, its estimate over the simulation, and per baseline ILP
throughput / baseline throughput (> 1: the ILP is faster; the baseline's TP degree beside it where
above 1); `no fit` where a baseline finds no plan. The summary says whether the ILP is best or tied
in every case and whether every plan's estimate is within EST_SIM_TOLERANCE of its simulation.
The large case is planned under ZB-H1 too (`--schedule zbh1`, offered on request only), beside the ILP's
own plan, with its estimate, idle fraction and whether that meets the bubble target.
Writes benchmarks/results/plan_quality.json (--large-only: plan_quality_large.json).
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
# models planned on one cluster only (and its batch): Llama-2-70B on the 1024-GPU fleet, where the plan
# should use tensor parallelism inside nodes with an estimated bubble of at most LARGE_BUBBLE_TARGET; at
# the model's own sequence length (Llama-2's 4096, not the 1024 the llama7b rows trace at)
LARGE_CASES = (("llama70b", "large-1024", 1024, "4096"),)
LARGE_BUBBLE_TARGET = 0.15
STRATEGIES = ("ilp", *SOLVERS)
GLOBAL_BATCH = 64
SAMPLES_PER_DEVICE = 1        # larger clusters get a larger batch: max(GLOBAL_BATCH, devices)
EST_SIM_TOLERANCE = 0.05      # every plan's estimate within 5% of its simulated iteration time
TIE = 1e-9                    # ratios this close to 1 are ties


def evaluate(model: common.TracedModel, spec: ClusterSpec, strategy: str, batch: int,
             plan_path: Path | None = None, schedule: str = "auto") -> dict[str, Any]:
    """Plan with one strategy and simulate it; the error instead when it finds no plan. With
    `plan_path`, the plan is written there (to compare plans across versions byte for byte)."""
    t0 = time.perf_counter()
    try:
        plan, _ = common.plan_with(model, spec, PlanOptions(global_batch=batch, strategy=strategy, schedule=schedule))
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
            "estimate_vs_simulation": plan.estimates.iteration_s / sim.iteration_s,
            "tp_degree": plan.tp_degree, "zero": any(g.zero for g in plan.grad_groups),
            "estimated_bubble_fraction": plan.estimates.bubble_fraction,
            "layout": sorted(f"{r.node_group}:{len(r.stages)}st:{r.batch_share}" for r in plan.replicas)}


def row(cluster: str, batch: int, results: dict[str, dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    ilp = results["ilp"]
    est_ok = all(abs(r["estimate_vs_simulation"] - 1) <= EST_SIM_TOLERANCE for r in results.values() if r["fits"])
    if not ilp["fits"]:
        return ([cluster, str(batch), "no plan", "-", "-"] + ["-"] * len(SOLVERS) + ["-"],
                {"ilp_fits": False, "estimates_within_tolerance": est_ok})
    tput = ilp["simulated_throughput_samples_s"]
    cells, ratios = [], {}
    for name in SOLVERS:
        r = results[name]
        if r["fits"]:
            ratios[name] = tput / r["simulated_throughput_samples_s"]
            cells.append(f"{ratios[name]:.2f}x" + (f" tp{r['tp_degree']}" if r["tp_degree"] > 1 else ""))
        else:
            cells.append("no fit")
    best = min(ratios.values()) if ratios else None
    verdict = "-" if best is None else ("tied" if abs(best - 1) <= TIE else "ok" if best > 1 else "ILP LOSES")
    shown = f"{tput:,.0f}" if tput >= 10 else f"{tput:.2g}"     # a few samples/s keep their digits
    chosen = f"tp{ilp['tp_degree']}" + (" zero" if ilp["zero"] else "")
    return ([cluster, str(batch), shown, chosen, f"{ilp['estimate_vs_simulation']:.3f}", *cells, verdict],
            {"ilp_fits": True, "ratio_vs": ratios, "ilp_vs_best_baseline": best,
             "ilp_best_or_tied": best is None or best >= 1 - TIE, "ilp_tp_degree": ilp["tp_degree"],
             "ilp_zero": ilp["zero"], "estimates_within_tolerance": est_ok})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt and resnet only, global batch 64")
    parser.add_argument("--large-only", action="store_true", help="the Llama-2-70B case alone")
    parser.add_argument("--plans-dir", type=Path, default=None,
                        help="write each case's plan.json as DIR/<model>/<cluster>/<strategy>.json")
    args = parser.parse_args()
    models = QUICK_MODELS if args.quick else MODELS
    clusters = [(path.stem, load_cluster(path)) for path in common.cluster_files()]
    report: dict[str, Any] = {"seq_len_llama": os.environ["HETPLAN_SEQ_LEN"], "models": {}}
    for name in () if args.large_only else models:
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
        print(common.table(["cluster", "batch", "ilp samples/s", "ilp tp/zero", "est/sim",
                            *(f"vs {s}" for s in SOLVERS),
                            "ilp >= best"], rows))
        report["models"][name] = {"blocks": len(model.blocks), "trace_s": model.trace_s, "clusters": per_cluster}
    for name, cluster, batch, seq_len in () if args.quick else LARGE_CASES:
        shorter, os.environ["HETPLAN_SEQ_LEN"] = os.environ["HETPLAN_SEQ_LEN"], seq_len   # read at the model's import
        model = common.trace(name)
        os.environ["HETPLAN_SEQ_LEN"] = shorter
        spec = dict(clusters)[cluster]
        folder = args.plans_dir / name / cluster if args.plans_dir else None
        results = {s: evaluate(model, spec, s, batch, folder / f"{s}.json" if folder else None) for s in STRATEGIES}
        cells, summary = row(cluster, batch, results)
        ilp = results["ilp"]
        if ilp["fits"]:
            summary["bubble_target"] = LARGE_BUBBLE_TARGET
            summary["meets_bubble_target"] = ilp["tp_degree"] > 1 and \
                ilp["estimated_bubble_fraction"] <= LARGE_BUBBLE_TARGET
        print(f"\n== examples/{name} on {cluster}: {len(model.blocks)} blocks")
        print(common.table(["cluster", "batch", "ilp samples/s", "ilp tp/zero", "est/sim",
                            *(f"vs {s}" for s in SOLVERS), "ilp >= best"], [cells]))
        zbh1 = evaluate(model, spec, "ilp", batch, folder / "ilp-zbh1.json" if folder else None, schedule="zbh1")
        summary["zbh1"] = zbh1
        if zbh1["fits"]:
            summary["zbh1_meets_bubble_target"] = zbh1["tp_degree"] > 1 and \
                zbh1["estimated_bubble_fraction"] <= LARGE_BUBBLE_TARGET
        if ilp["fits"]:
            print(f"estimated bubble {ilp['estimated_bubble_fraction']:.1%} (target <= {LARGE_BUBBLE_TARGET:.0%})")
        if zbh1["fits"]:
            print(f"under --schedule zbh1: TP {zbh1['tp_degree']}, estimated {zbh1['estimated_iteration_s']:.2f} s "
                  f"(the plan above: {ilp['estimated_iteration_s']:.2f} s), bubble "
                  f"{zbh1['estimated_bubble_fraction']:.1%}, estimate / simulation "
                  f"{zbh1['estimate_vs_simulation']:.3f}")
        report["models"][name] = {"blocks": len(model.blocks), "trace_s": model.trace_s, "seq_len": seq_len,
                                  "clusters": {cluster: {"global_batch": batch, "results": results, **summary}}}
    cases = [c for m in report["models"].values() for c in m["clusters"].values()]
    report["ilp_best_or_tied_everywhere"] = all(c.get("ilp_best_or_tied", True) for c in cases)
    report["estimates_within_tolerance_everywhere"] = all(c["estimates_within_tolerance"] for c in cases)
    report["est_sim_tolerance"] = EST_SIM_TOLERANCE
    print("\nvs X: simulated ILP throughput / simulated X throughput (tpN: X's tensor-parallel degree); est/sim: "
          "the ILP plan's own estimate of its iteration time over the simulated one")
    print(f"ILP best or tied in every case: {report['ilp_best_or_tied_everywhere']}; every plan's estimate within "
          f"{EST_SIM_TOLERANCE:.0%} of its simulation: {report['estimates_within_tolerance_everywhere']}")
    out = common.write_json("plan_quality_large" if args.large_only else "plan_quality", report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
