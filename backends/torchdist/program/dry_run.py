"""A dry run: every rank's stage built as the program builds it, on meta, without hardware or peers.

`plan run OUT --dry-run` runs this once per distinct replica shape (its cut points and micro-batch
sizes: the ranks of replicas cut alike build the same graphs), each in a process of its own, as
`python -m program.dry_run --replica R` from the plan directory. The process does a rank's start-up:
imports, the model built on meta (materialise.build_meta), traced and split at each micro-batch size
(stages.StageGraphs), then runs each stage's forward and backward once on meta tensors (the check `plan`
ran, passes.stage_check). It prints one JSON record per stage of the replica: the parameters the stage
holds, the activation bytes its backward keeps per micro-batch, the seconds of start-up (from the
process's start to its graphs ready) and the process's peak resident memory (VmHWM): a rank of that
replica needs no more to start, before its own tensors get values.
"""

# ruff: noqa: E402  (the package set-up must come before the relative imports)
from __future__ import annotations

import time

STARTED_S = time.perf_counter()

import sys
from pathlib import Path

if not __package__:   # run as a file: import the units as a package (PEP 366), as train.py does
    _folder = Path(__file__).resolve().parent
    if sys.path and Path(sys.path[0]).resolve() == _folder:
        sys.path[0] = str(_folder.parent)     # not the folder itself: its units would shadow stdlib names
    else:
        sys.path.insert(0, str(_folder.parent))
    __package__ = _folder.name
    __import__(__package__)

import argparse
import json

import torch

from passes.stage_check import check_stage_runs
from planner import frontend
from planner.core.errors import HetplanError
from planner.core.ir import Plan

from . import data, materialise, memory, stages, tensor_parallel


def replica_records(plan: Plan, here: Path, replica: int, seed: int = 0) -> list[dict[str, object]]:
    """The dry run of one replica: one record per stage (see the module docstring)."""
    functions = dict(plan.program.functions) if plan.program else {}
    model_file = frontend.load_model_file(here / "model.py", functions)
    shape = plan.replicas[replica]
    meta = materialise.build_meta(model_file, seed)
    degree = shape.tp_degree        # tensor parallelism: shard 0's graphs (meta skips the collectives)
    shards = tensor_parallel.Shards(degree, 0, None) if degree > 1 else None
    graphs = stages.StageGraphs(meta, model_file, [s.last_node for s in shape.stages], shape.micro_batch_sizes,
                                lambda rows: data.meta_inputs(model_file, rows),
                                shard=shards.shard_graph if shards else None)
    split = shards.specs() if shards else {}
    start_up_s = time.perf_counter() - STARTED_S
    replica_params: dict[int, torch.nn.Parameter] = {}
    out: list[dict[str, object]] = []
    batches = {rows: frontend.to_device(frontend.example_batch_for_step(model_file, rows, 0), "meta")
               for rows in graphs.sizes}          # (inputs, target) on meta, one per micro-batch size
    for stage in shape.stages:
        saved_bytes = max(check_stage_runs(graphs.split_at(rows), stage.index, model_file, *batches[rows]).saved_bytes
                          for rows in graphs.sizes)
        names = graphs.tensor_names(stage.index)
        held = {name: meta.module.get_parameter(name) for name in names if name not in meta.buffers}
        unique = {id(p): p for p in held.values()}
        replica_params.update(unique)
        shard_numel = {id(p): p.numel() // (degree if name in split else 1) for name, p in held.items()}
        out.append({"rank": stage.rank, "replica": replica, "stage": stage.index, "device": stage.device_label,
                    "param_count": sum(shard_numel[i] for i in unique),
                    "param_bytes": sum(shard_numel[i] * p.element_size() for i, p in unique.items()),
                    "saved_activation_bytes": saved_bytes, "micro_batch_sizes": graphs.sizes,
                    "start_up_s": round(start_up_s, 3), "peak_memory_bytes": memory.own_peak_resident_bytes()})
    for record in out:      # every parameter once, tied ones too: the replica holds the whole model
        record["replica_param_count"] = sum(p.numel() for p in replica_params.values())
        record["model_param_count"] = sum(p.numel() for p in meta.module.parameters())
    return out


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description="Build one replica's stages on meta, as its ranks would.")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        plan = Plan.load(here / "plan.json")
        for record in replica_records(plan, here, args.replica, args.seed):
            print(json.dumps(record), flush=True)
    except HetplanError as exc:
        print(f"dry_run.py: {exc.one_line()}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
