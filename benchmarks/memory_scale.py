"""Memory at scale: a 374M-parameter Llama planned in 4 stages on 4 CPU processes, trained 2 steps.

Each rank builds only its own stage (the model on meta, its tensors given values on their own), so its
measured peak (VmHWM, metrics.jsonl) must be a fraction of one process training the whole model, and
close to the plan's per-rank estimate. The single-process run is backends/torchdist/reference.py (the
same model, global batch and AdamW) in a process of its own, its peak read the same way.

    python benchmarks/memory_scale.py [--steps 2] [--out benchmarks/results/memory_scale.json]
    python benchmarks/memory_scale.py --schedule zbh1 --out benchmarks/results/memory_scale_zbh1.json

Prints the table and writes JSON. Targets: every rank at most 0.4x the single process, within 15% of
its estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: E402  (benchmarks/: puts the checkout on sys.path)

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "benchmarks" / "models" / "llama_350m.py"
CLUSTER = REPO / "benchmarks" / "clusters" / "cpu-homog-4.yaml"
GLOBAL_BATCH = 8
STAGES = 4
MIB = 2**20
MAX_SHARE_OF_SINGLE = 0.4
MAX_ESTIMATE_ERROR = 0.15

SINGLE = """
import json, sys, torch
torch.set_num_threads(1)
from backends.torchdist.reference import train_reference
from backends.torchdist.program.memory import own_peak_resident_bytes
run = train_reference(sys.argv[1], global_batch=int(sys.argv[2]), steps=int(sys.argv[3]), seed=0)
print(json.dumps({"peak_memory_bytes": own_peak_resident_bytes(), "losses": run.losses,
                  "param_count": sum(p.numel() for p in run.params.values())}))
"""


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "planner.cli", *args], check=True, cwd=REPO, env=_env(),
                   stdout=subprocess.DEVNULL)


def measure(steps: int, work: Path, schedule: str = "auto") -> dict[str, object]:
    out = work / "out"
    _cli(str(MODEL), "--cluster", str(CLUSTER), "--global-batch", str(GLOBAL_BATCH), "--stages", str(STAGES),
         "--use-all-devices", "--no-runners-up", "--schedule", schedule, "-o", str(out))
    t0 = time.perf_counter()
    _cli("run", str(out), "--steps", str(steps))
    run_s = time.perf_counter() - t0
    ranks: dict[int, dict[str, float]] = {}
    for line in (out / "run" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        mine = ranks.setdefault(rec["rank"], {"stage": rec["stage"], "peak_memory_bytes": 0,
                                              "estimated_memory_bytes": rec["estimated_memory_bytes"]})
        mine["peak_memory_bytes"] = max(mine["peak_memory_bytes"], rec["peak_memory_bytes"])
    plan = json.loads((out / "plan.json").read_text())
    t0 = time.perf_counter()
    single = json.loads(subprocess.run([sys.executable, "-c", SINGLE, str(MODEL), str(GLOBAL_BATCH), str(steps)],
                                       check=True, capture_output=True, text=True, cwd=REPO,
                                       env=_env()).stdout.strip().splitlines()[-1])
    single_s = time.perf_counter() - t0
    rows = []
    for rank, rec in sorted(ranks.items()):
        peak, est = float(rec["peak_memory_bytes"]), float(rec["estimated_memory_bytes"])
        rows.append({"rank": rank, "stage": int(rec["stage"]), "peak_memory_bytes": int(peak),
                     "estimated_memory_bytes": int(est), "estimate_error": (peak - est) / est,
                     "share_of_single": peak / single["peak_memory_bytes"]})
    ok = all(r["share_of_single"] <= MAX_SHARE_OF_SINGLE and abs(r["estimate_error"]) <= MAX_ESTIMATE_ERROR
             for r in rows)
    return {"model": str(MODEL.relative_to(REPO)), "param_count": single["param_count"], "stages": STAGES,
            "global_batch": GLOBAL_BATCH, "steps": steps, "cluster": CLUSTER.name,
            "world_size": len(plan["replicas"][0]["stages"]) * len(plan["replicas"]),
            "single_process_peak_bytes": single["peak_memory_bytes"], "ranks": rows,
            "targets": {"max_share_of_single": MAX_SHARE_OF_SINGLE, "max_estimate_error": MAX_ESTIMATE_ERROR},
            "meets_targets": ok, "run_s": round(run_s, 1), "single_s": round(single_s, 1)}


def table(result: dict[str, object]) -> str:
    lines = [f"{result['model']}: {int(str(result['param_count'])):,} parameters, {result['stages']} stages, "
             f"global batch {result['global_batch']}, {result['steps']} steps; one process peaks at "
             f"{int(str(result['single_process_peak_bytes'])) / MIB:,.0f} MiB",
             f"{'rank':>4}  {'stage':>5}  {'peak MiB':>9}  {'estimate MiB':>12}  {'error':>7}  {'of one process':>14}"]
    for r in result["ranks"]:  # type: ignore[attr-defined]
        lines.append(f"{r['rank']:>4}  {r['stage']:>5}  {r['peak_memory_bytes'] / MIB:>9,.0f}  "
                     f"{r['estimated_memory_bytes'] / MIB:>12,.0f}  {r['estimate_error']:>+7.1%}  "
                     f"{r['share_of_single']:>14.2f}")
    lines.append(f"targets (every rank <= {MAX_SHARE_OF_SINGLE}x one process, |error| <= {MAX_ESTIMATE_ERROR:.0%}): "
                 f"{'met' if result['meets_targets'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--schedule", default="auto", help="the plan's --schedule (zbh1: every stage keeps S micro-batches)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "memory_scale.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetplan-memory-") as work:
        result = measure(args.steps, Path(work), args.schedule)
    print(table(result))
    common.write_json_to(args.out, result)
    print(f"wrote {args.out}")
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
