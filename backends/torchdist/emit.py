"""Emit `out/program/`: a readable training program for one plan, its launcher and its plan."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

from planner.core.ir import Plan

TRAIN_TEMPLATE = '''\
"""Training program emitted by hetplan for cluster `{cluster}` (global batch {global_batch}).

{layout}

Launch on one machine with ./launch.sh (torchrun), or `plan run <plan dir>`. Initial weights equal
`torch.manual_seed(seed); model()` on one process; step k trains on the rows of
`batch({global_batch}, k)`, split across replicas in plan order by their shares; gradients are
summed per gradient group (replicas, and stages that share a weight) so the update equals
single-process training on the whole batch. Groups sync with the plan's compressor (`none`: exact);
under AdamW a `onebit` group trains with 1-bit Adam instead (exact AdamW for --onebit-freeze-step
steps, by default a quarter of the run, then frozen variance and 1-bit compressed momentum in place
of its gradients). Pipeline
edges send activations with their compressor. Stages compute in the plan's precision on CUDA
(bf16 / fp16 autocast, fp16 with loss scaling); CPU ranks stay fp32 unless --cpu-autocast.
Each step appends a JSON line to <out>/metrics.jsonl.
"""

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist

from backends.torchdist import comm, runtime
from costmodel.compression import onebit_adam_freeze_step
from planner import frontend

HERE = Path(__file__).resolve().parent
PLAN = runtime.load_plan(HERE / "plan.json")
MODEL_FILE = HERE / "model.py"
NAMES = {names!r}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default={lr!r}, help="learning rate (torch defaults otherwise)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default={optimizer!r},
                   help="AdamW or SGD with momentum 0.9 (default: the one planned for)")
    p.add_argument("--onebit-freeze-step", type=int, default=None,
                   help="1-bit Adam (onebit groups under AdamW): exact AdamW steps before the variance "
                        "freezes (default: a quarter of --steps)")
    p.add_argument("--out", type=Path, default=HERE.parent / "run", help="metrics and final weights")
    p.add_argument("--save-final", action="store_true", help="write each rank's final parameters")
    p.add_argument("--cpu-autocast", action="store_true",
                   help="apply the plan's bf16/fp16 precision on CPU ranks too (default: fp32 on CPU)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    ctx = comm.init(PLAN)                                   # rank -> (replica, stage, device)
    model_file = frontend.load_model_file(MODEL_FILE, NAMES)
    model = runtime.build_model(model_file, args.seed)      # same values as one process
    stage = runtime.StageProgram(PLAN, ctx, model_file, model, cpu_autocast=args.cpu_autocast)
    freeze_step = (onebit_adam_freeze_step(args.steps) if args.onebit_freeze_step is None
                   else args.onebit_freeze_step)
    optimizer = stage.make_optimizer(args.optimizer, args.lr, onebit_freeze_step=freeze_step)
    metrics = runtime.Metrics(args.out, ctx)
    for step in range(args.steps):
        start = time.perf_counter()
        stage.reset_counters()
        contribution = stage.train_step(step)               # schedule: forward/backward + p2p
        stage.sync_gradients(optimizer)                     # per gradient group, its compressor
        stage.optimizer_step(optimizer)                     # (skipped everywhere on fp16 overflow;
                                                            #  1-bit Adam exchanges momentum here)
        optimizer.zero_grad(set_to_none=False)
        step_time_s = time.perf_counter() - start
        loss = torch.tensor([contribution], dtype=torch.float64)
        dist.all_reduce(loss)                               # mean over the global batch
        metrics.log(step=step, loss=float(loss), step_time_s=step_time_s,
                    peak_memory_bytes=runtime.peak_memory_bytes(ctx.device),
                    p2p_bytes=stage.p2p.bytes_sent, grad_bytes=stage.grad_bytes_reduced,
                    grad_wire_bytes=stage.grad_wire_bytes,
                    grad_wire_bytes_by_group=stage.grad_wire_bytes_by_group,
                    compute_dtype=str(stage.compute_dtype).removeprefix("torch."),
                    loss_scale=stage.scaler.scale if stage.scaler else None,
                    skipped_step=stage.skipped_step)
    if args.save_final:
        stage.save_final(args.out)
    dist.barrier()
    del stage, optimizer
    gc.collect()                                            # release gloo work before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

LAUNCH_TEMPLATE = '''\
#!/usr/bin/env bash
# Launches the plan's {world} processes. Single machine (the default here):
#   ./launch.sh --steps 20
# Several machines: run on each node with NNODES, NODE_RANK and MASTER_ADDR set, e.g.
#   NNODES={nnodes} NODE_RANK=0 MASTER_ADDR=host0 ./launch.sh
set -euo pipefail
cd "$(dirname "$0")"
if [ "${{NNODES:-1}}" = "1" ]; then
  exec python -m torch.distributed.run --standalone --nproc-per-node {world} train.py "$@"
fi
exec python -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \\
  --nproc-per-node {per_node} --master-addr "$MASTER_ADDR" --master-port "${{MASTER_PORT:-29500}}" \\
  train.py "$@"
'''


def layout_text(plan: Plan) -> str:
    lines = ["Layout (rank: replica/stage on device, blocks, micro-batches):"]
    for r in plan.replicas:
        for s in r.stages:
            lines.append(f"  rank {s.rank}: replica {r.index} stage {s.index} on {s.device_label} "
                         f"({s.device_type}, {s.precision}), blocks {s.first_block}-{s.last_block}, "
                         f"share {r.batch_share} as micro-batches {list(r.micro_batch_sizes)}")
    return "\n".join(lines)


def emit_program(plan: Plan, model_path: Path, program_dir: Path, *, names: dict[str, str],
                 lr: float = 1e-3, optimizer: str = "adamw") -> None:
    """Write train.py, launch.sh, plan.json and a copy of the model file into `program_dir`."""
    program_dir.mkdir(parents=True, exist_ok=True)
    plan.save(program_dir / "plan.json")
    shutil.copyfile(model_path, program_dir / "model.py")
    (program_dir / "train.py").write_text(TRAIN_TEMPLATE.format(
        cluster=plan.inputs.cluster_name, global_batch=plan.global_batch, layout=layout_text(plan),
        names=names, lr=lr, optimizer=optimizer))
    nodes = len({label.split(":")[0] for label in plan.devices})
    launch = program_dir / "launch.sh"
    launch.write_text(LAUNCH_TEMPLATE.format(world=plan.world_size, nnodes=nodes,
                                             per_node=max(1, plan.world_size // max(nodes, 1))))
    launch.chmod(launch.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
