"""Rebalancing after drift: a device slows down 1x -> 3x mid-run; with --rebalance the program moves its
replica's rows to the others, and its step time comes close to that of a fresh plan for the new speeds.

    python benchmarks/rebalance.py                     # GPT on cpu-hetero-4, 2 interleaved repetitions
    python benchmarks/rebalance.py --reps 1 --steps 21 --window 15 20   # a smoke run

The example GPT is planned on examples/clusters/cpu-hetero-4.yaml (2 fast + 2 three times slower CPU
processes; `--stages 1 --use-all-devices`: four replicas, uneven shares). Three runs of the emitted
program, each `--steps` steps, `slow:fast/0:0=3@10` injected in the first two (program/faults.py: from
step 10 on, that device computes 3x slower than planned):

  drifted      the original plan, no rebalancing: the replica on fast/0:0 keeps its share
  rebalanced   the original plan with --rebalance (program/rebalance.py)
  fresh        a new plan of a temporary spec in which fast/0:0 is a device type of its own with
               slowdown 3 (the spec's slowdown is per device type; that type sits on a node of its own),
               no fault: what planning for the new speeds from the start gives

The three alternate, `--reps` times (interleaved: the host's load changes alike for all of them). The
figure is each run's median step time (the slowest rank's per step) over the steps of `--window`
[first, last]; per variant the median over its repetitions. The target: rebalanced within TARGET of
fresh. Prints a table, writes benchmarks/results/rebalance.json.

The emulated slowdown is busy padding on shared cores (program/slowdown.py): on a host with fewer
cores than ranks, rows moved to a slow replica also cost the others CPU time, so measured gains are
smaller than on separate devices.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # runnable as `python benchmarks/rebalance.py` from anywhere
    sys.path.insert(0, str(REPO))

from backends.torchdist.local_run import run_program  # noqa: E402
from backends.torchdist.program.metrics import read_metrics  # noqa: E402
from planner.core.ir import Plan  # noqa: E402

MODEL = REPO / "examples" / "gpt" / "model.py"
CLUSTER = REPO / "examples" / "clusters" / "cpu-hetero-4.yaml"
RESULTS = REPO / "benchmarks" / "results" / "rebalance.json"
GLOBAL_BATCH = 96                 # large enough that compute, not the gradient sync, sets the step
DRIFTED_DEVICE = "fast/0:0"
DRIFT_FACTOR = 3.0
DRIFT_STEP = 10
DEFAULT_STEPS = 31                # steps 0..30
DEFAULT_WINDOW = (20, 30)         # the steps whose step times are compared
DEFAULT_REPS = 2
TARGET = 0.15                     # rebalanced within 15% of a fresh plan's step time
SEED, LR = 0, 1e-3
COLLECTIVE_TIMEOUT_S = 120
PLAN_TIMEOUT_S = 600
DRIFTED_TYPE = "cpu-fast-3x"      # the temporary spec's type of the drifted device


@dataclass(frozen=True)
class Run:
    variant: str
    rep: int
    shares_first: tuple[int, ...]     # the shares the run started with
    shares_last: tuple[int, ...]      # ... and ended with (after any rebalance)
    rebalances: tuple[dict[str, Any], ...]
    window_step_s: float              # median over the window of the slowest rank's step time
    wall_s: float


def plan_into(out: Path, cluster: Path) -> Plan:
    """`plan` the GPT on `cluster` into `out` (the CLI: trace, cost, solve, verify, emit)."""
    cmd = [sys.executable, "-m", "planner.cli", str(MODEL), "--cluster", str(cluster), "--global-batch",
           str(GLOBAL_BATCH), "--stages", "1", "--use-all-devices", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=PLAN_TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"plan failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return Plan.load(out)


def drifted_spec(folder: Path) -> Path:
    """cpu-hetero-4 with the drifted device as a type of its own (slowdown DRIFT_FACTOR x its type's), on a
    node of its own: its node group's other device keeps the old type."""
    spec = yaml.safe_load(CLUSTER.read_text())
    group_name = DRIFTED_DEVICE.split("/")[0]
    nodes = []
    for node in spec["nodes"]:
        if node["name"] != group_name:
            nodes.append(node)
            continue
        if node.get("count", 1) != 1:
            raise ValueError(f"{CLUSTER}: node group {group_name} must be one node to split off a device")
        base = spec["devices"][node["device"]]
        spec["devices"][DRIFTED_TYPE] = {**base, "slowdown": base.get("slowdown", 1.0) * DRIFT_FACTOR}
        rest = {**node, "per_node": node["per_node"] - 1}
        nodes += [{**node, "name": f"{group_name}-drifted", "device": DRIFTED_TYPE, "per_node": 1}, rest]
    spec["nodes"] = nodes
    spec["name"] = f"{spec['name']}-drifted"
    path = folder / "cpu-hetero-4-drifted.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_once(variant: str, rep: int, out: Path, steps: int, window: tuple[int, int], extra: list[str]) -> Run:
    plan = Plan.load(out)
    run_dir = out / f"run-{variant}-{rep}"
    start = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    outcome = run_program(plan, out / "program", run_dir,
                          ["--steps", str(steps), "--seed", str(SEED), "--lr", str(LR), *extra],
                          timeout_s=COLLECTIVE_TIMEOUT_S)
    if outcome.returncode:
        raise RuntimeError(f"{variant} run failed: {outcome.message} (logs: {run_dir / 'logs'})")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    per_step = {s: max(m["step_time_s"] for m in metrics if m["step"] == s) for s in range(steps)}
    rank0 = [m for m in metrics if m["rank"] == 0]
    rebalances = tuple(m["rebalance"] for m in rank0 if "rebalance" in m)
    applied = [r for r in rebalances if r["applied"]]
    first = tuple(r.batch_share for r in plan.replicas)
    return Run(variant, rep, first, tuple(applied[-1]["new_shares"]) if applied else first, rebalances,
               statistics.median(per_step[s] for s in range(window[0], window[1] + 1)),
               time.perf_counter() - start)


def table(runs: list[Run], medians: dict[str, float]) -> str:
    header = ["variant", "shares at start", "shares at end", "rebalances", "step (median)", "vs fresh"]
    rows = []
    for variant, step_s in medians.items():
        mine = [r for r in runs if r.variant == variant]
        rows.append([variant, str(list(mine[0].shares_first)), " / ".join(str(list(r.shares_last)) for r in mine),
                     " / ".join(str(sum(x["applied"] for x in r.rebalances)) for r in mine),
                     f"{step_s * 1e3:.1f} ms", f"{step_s / medians['fresh'] - 1.0:+.1%}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--window", type=int, nargs=2, default=list(DEFAULT_WINDOW), metavar=("FIRST", "LAST"))
    p.add_argument("--reps", type=int, default=DEFAULT_REPS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    window = (args.window[0], args.window[1])
    if not DRIFT_STEP < window[0] <= window[1] < args.steps:
        p.error(f"the window must lie after the drift at step {DRIFT_STEP} and inside the {args.steps} steps")
    fault = f"slow:{DRIFTED_DEVICE}={DRIFT_FACTOR:g}@{DRIFT_STEP}"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hetplan-rebalance-") as tmp:
        work = Path(tmp)
        original = plan_into(work / "original", CLUSTER)
        fresh = plan_into(work / "fresh", drifted_spec(work))
        variants = {"drifted": (work / "original", ["--fault", fault]),
                    "rebalanced": (work / "original", ["--fault", fault, "--rebalance"]),
                    "fresh": (work / "fresh", [])}
        runs = []
        for rep in range(args.reps):
            for variant, (out, extra) in variants.items():
                runs.append(run_once(variant, rep, out, args.steps, window, extra))
                print(f"  {variant} (rep {rep + 1}/{args.reps}): {runs[-1].window_step_s * 1e3:.1f} ms per step "
                      f"over steps {window[0]}-{window[1]}", flush=True)
        plans = {"original": original, "fresh": fresh}
    medians = {v: statistics.median(r.window_step_s for r in runs if r.variant == v) for v in variants}
    gap = medians["rebalanced"] / medians["fresh"] - 1.0
    print(table(runs, medians))
    print(f"rebalanced vs fresh plan: {gap:+.1%} (target: within {TARGET:.0%}); "
          f"drifted without rebalancing: {medians['drifted'] / medians['fresh'] - 1.0:+.1%}")
    result = {
        "model": str(MODEL.relative_to(REPO)), "cluster": str(CLUSTER.relative_to(REPO)),
        "global_batch": GLOBAL_BATCH, "fault": fault, "steps": args.steps, "window": list(window),
        "reps": args.reps, "target": TARGET, "rebalanced_vs_fresh": gap, "within_target": gap <= TARGET,
        "median_step_s": medians,
        "plans": {name: {"devices": list(pl.devices), "shares": [r.batch_share for r in pl.replicas],
                         "micro_batch_sizes": [list(r.micro_batch_sizes) for r in pl.replicas]}
                  for name, pl in plans.items()},
        "runs": [asdict(r) for r in runs],
        "host": {"cpus": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0],
                 "python": platform.python_version(), "wall_s": time.perf_counter() - started},
        "command": " ".join(["python benchmarks/rebalance.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if gap <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
