"""`plan run OUT --dry-run`: every rank's stage built on meta by the program's own start-up, on this machine.

Replicas cut alike at the same micro-batch sizes build the same graphs, so one process per distinct
replica shape (program/dry_run.py) stands for all of its ranks; each rank's record takes its own rank,
device and stage from the plan. The records go to OUT/dry_run.json (a run's folder OUT/run is left as it
is); the table groups ranks that share a shape and a stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from planner.core.errors import HetplanError, printable
from planner.core.ir import Plan

DRY_RUN_FILE = "dry_run.json"
MIB = 2**20


class DryRunError(HetplanError):
    """A replica's stages did not build or run on meta (its process's own line says why)."""

    exit_code = 1


def replica_shapes(plan: Plan) -> dict[tuple[tuple[str, ...], tuple[int, ...]], list[int]]:
    """(cut points, distinct micro-batch sizes) -> the replicas of that shape, in plan order."""
    shapes: dict[tuple[tuple[str, ...], tuple[int, ...]], list[int]] = {}
    for r in plan.replicas:
        key = (tuple(s.last_node for s in r.stages), tuple(sorted(set(r.micro_batch_sizes))))
        shapes.setdefault(key, []).append(r.index)
    return shapes


def dry_run(plan: Plan, program_dir: Path, out_dir: Path, *, seed: int = 0,
            timeout_s: float = 600) -> list[dict[str, object]]:
    """Run program/dry_run.py once per replica shape; one record per rank (rank order), also written to
    out_dir/dry_run.json. Raises DryRunError with the failing process's last line."""
    records: list[dict[str, object]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    program_dir = program_dir.resolve()     # the script runs in that folder: a relative path would not reach it
    for replicas in replica_shapes(plan).values():
        cmd = [sys.executable, str(program_dir / "dry_run.py"), "--replica", str(replicas[0]), "--seed", str(seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=program_dir)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            raise DryRunError(f"replica {replicas[0]}'s stages do not build: "
                              f"{printable(lines[-1][:400]) if lines else f'exit {proc.returncode}'}",
                              file=str(program_dir / "dry_run.py"), fix="re-plan with this model file")
        built = {int(rec["stage"]): rec for rec in map(json.loads, proc.stdout.splitlines())}
        for index in replicas:
            for stage in plan.replicas[index].stages:
                for rank, _, label in stage.rank_devices():     # each tensor-parallel shard alike
                    records.append({**built[stage.index], "rank": rank, "replica": index, "device": label,
                                    "estimated_memory_bytes": stage.memory_bytes, "shape_of_replica": replicas[0]})
    records.sort(key=lambda rec: int(str(rec["rank"])))
    tmp = out_dir / f".{DRY_RUN_FILE}.tmp"
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(out_dir / DRY_RUN_FILE)
    return records


def table(plan: Plan, records: list[dict[str, object]]) -> str:
    """One row per replica shape and stage (its ranks counted), and the totals a user checks."""
    rows = [("ranks", "replicas like", "stage", "parameters", "param MiB", "activations MiB/mb", "start-up s",
             "peak MiB")]
    seen: dict[tuple[object, object], list[dict[str, object]]] = {}
    for rec in records:
        seen.setdefault((rec["shape_of_replica"], rec["stage"]), []).append(rec)
    for (shape, stage), group in seen.items():
        first = group[0]
        ranks = f"{first['rank']}" if len(group) == 1 else f"{first['rank']}.. ({len(group)})"
        rows.append((ranks, str(shape), str(stage), f"{first['param_count']:,}",
                     f"{int(str(first['param_bytes'])) / MIB:,.0f}",
                     f"{int(str(first['saved_activation_bytes'])) / MIB:,.1f}", f"{first['start_up_s']}",
                     f"{int(str(first['peak_memory_bytes'])) / MIB:,.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    slowest = max(records, key=lambda rec: float(str(rec["start_up_s"])))
    fullest = max(records, key=lambda rec: int(str(rec["peak_memory_bytes"])))
    held = sorted({int(str(rec["replica_param_count"])) for rec in records})
    model = int(str(records[0]["model_param_count"]))
    holds = (f"every replica holds all {model:,} parameters of the model" if held == [model] else
             f"replicas hold {', '.join(f'{n:,}' for n in held)} of the model's {model:,} parameters")
    lines.append(f"{holds}; slowest start-up {slowest['start_up_s']} s "
                 f"(rank {slowest['rank']}), largest peak {int(str(fullest['peak_memory_bytes'])) / MIB:,.0f} MiB "
                 f"(rank {fullest['rank']}), before a rank's own tensors get values")
    return "\n".join(lines)
