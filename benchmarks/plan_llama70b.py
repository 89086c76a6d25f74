"""Plan Llama-2-70B (transformers LlamaConfig, 80 layers) on the 1024-GPU mixed cluster.

Shows that planning allocates no weights: prints the time per phase (load = importing the model file,
which imports transformers; trace = export on meta of 5 of the 80 layers, replicated to all 80, then
annotate and blocks), the whole wall and CPU time and the peak RSS, writes
benchmarks/results/plan_llama70b.json. Run: python benchmarks/plan_llama70b.py [--cluster FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.api import PlanOptions, plan  # noqa: E402
from planner.frontend.repeated import REPLICATED_KEY  # noqa: E402

RSS_LIMIT_BYTES = 4 * 2**30


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default=str(REPO / "examples" / "clusters" / "large-1024.yaml"))
    p.add_argument("--global-batch", type=int, default=1024)
    args = p.parse_args()
    start, start_cpu = time.perf_counter(), time.process_time()
    result = plan(REPO / "examples" / "llama70b" / "model.py", args.cluster,
                  PlanOptions(global_batch=args.global_batch))
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in result.graph.parameters())
    meta_only = all(p.is_meta for p in result.graph.parameters())
    e = result.plan.estimates
    row = {
        "model": "llama70b", "cluster": Path(args.cluster).stem, "devices": result.cluster.num_devices,
        "parameters": params, "weights_allocated": not meta_only, "blocks": len(result.blocks),
        "replicated": [[r.path, r.length, r.traced] for r in result.graph.meta.get(REPLICATED_KEY, ())],
        **{k: round(v, 3) for k, v in result.timings_s.items()}, "wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3),
        "peak_rss_gib": round(peak_rss_bytes / 2**30, 3), "rss_limit_gib": RSS_LIMIT_BYTES / 2**30,
        "devices_used": result.plan.world_size, "replicas": len(result.plan.replicas),
        "estimated_step_s": round(e.iteration_s, 3), "solver_status": result.plan.solver.status,
        "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
    }
    width = max(len(k) for k in row)
    for k, v in row.items():
        print(f"{k.ljust(width)}  {v}")
    out = REPO / "benchmarks" / "results" / "plan_llama70b.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1) + "\n")
    ok = meta_only and peak_rss_bytes < RSS_LIMIT_BYTES
    print("OK" if ok else "FAILED: weights allocated or RSS over the limit")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
