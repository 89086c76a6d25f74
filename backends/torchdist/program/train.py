"""Training program emitted by hetplan: one process of a planned run, reading its plan from plan.json.

Run it on one machine with `plan run PLAN_DIR` (or ./launch.sh without NODE_RANK); on a cluster, on each
node k the plan uses, `NODE_RANK=k MASTER_ADDR=<node rank 0's address> ./launch.sh` (launch.sh lists
which node is which and starts there as many processes as the plan runs on it). From the plan
directory, `python -m program.train` runs a one-device plan without torchrun. Rank 0 prints the layout.

The training contract (the same as backends/torchdist/reference.py on one process):
- initial values follow the init contract (materialise.py): the model built on meta, each module's
  parameters initialised under a generator seeded from (seed, its name); a rank gives values only to its
  own stage's tensors, or reads them from --weights (weights.py);
- step k trains on the rows of `batch(global_batch, k)` (or of dataset()'s seeded selection, data.py),
  split across replicas in plan order by their shares, each share cut into the replica's micro-batches;
- each last stage weights its micro-batch losses by rows / global batch, and gradients are summed per
  gradient group (replicas, and stages that share a weight), so the update equals single-process
  training on the global batch; groups sync with the plan's compressor (`none`: exact); under AdamW a
  `onebit` group trains with 1-bit Adam (exact AdamW for --onebit-freeze-step steps, by default the
  plan's warm-up fraction of the run, then frozen variance and 1-bit compressed momentum in place
  of its gradients);
- pipeline edges send activations with the plan's activation compressor;
- stages compute in the plan's precision on CUDA (bf16 / fp16 autocast, fp16 with loss scaling shared
  by all ranks); CPU ranks stay fp32 unless --cpu-autocast;
- each step appends one JSON line per rank to <out>/metrics.jsonl; --save-final writes each rank's
  parameters to <out>/final/rank<r>.pt;
- with --checkpoint-every N the state after every N steps is saved by torch.distributed.checkpoint in the
  background (checkpoint.py: <out>/ckpt/step_<N>/, complete once marked), keyed by the model's names
  (checkpoint_state.py); --resume (or a restart by torchrun) continues from the latest complete one bit
  for bit, and --resume-from loads one of another plan of the same model.
"""

# ruff: noqa: E402  (the imports follow the package set-up and the lifeline, which must come first)
from __future__ import annotations

import sys
from pathlib import Path

if not __package__:   # run as a file (torchrun .../train.py): import the units as a package (PEP 366)
    _folder = Path(__file__).resolve().parent
    if sys.path and Path(sys.path[0]).resolve() == _folder:
        sys.path[0] = str(_folder.parent)     # not the folder itself: its units would shadow stdlib names
    else:
        sys.path.insert(0, str(_folder.parent))
    __package__ = _folder.name
    __import__(__package__)

from . import lifeline

lifeline.guard_worker()                       # before torch loads: no worker outlives its agent

import argparse
import functools
import gc
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from passes.tensor_parallel import ShardSpec
from planner import frontend
from planner.core.arguments import OneLineParser, count, positive_number
from planner.core.errors import HetplanError, OptionError
from planner.core.ir import Plan

from . import (
    checkpoint,
    checkpoint_reshard,
    checkpoint_state,
    comm_check,
    data,
    faults,
    gradsync,
    layout,
    materialise,
    memory,
    metrics,
    optimizers,
    pipeline,
    placement,
    precision,
    process_group,
    rebalance,
    stages,
    tensor_parallel,
    weights,
)

if TYPE_CHECKING:
    from . import checkpoint_save

DEFAULT_TIMEOUT_S = 60.0


def parse_args(plan: Plan, here: Path, argv: list[str] | None) -> argparse.Namespace:
    defaults = plan.program
    p = OneLineParser(prog="train.py", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=count("--steps", 1), default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=positive_number("--lr"), default=defaults.learning_rate if defaults else 1e-3,
                   help="learning rate (torch defaults otherwise; default: the one planned for)")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default=defaults.optimizer if defaults else "adamw",
                   help="AdamW or SGD with momentum 0.9 (default: the one planned for)")
    p.add_argument("--onebit-freeze-step", type=count("--onebit-freeze-step", 0), default=None,
                   help="1-bit Adam (onebit groups under AdamW): exact AdamW steps before the variance "
                        "freezes (default: the plan's warm-up fraction of --steps)")
    p.add_argument("--out", type=Path, default=here.parent / "run", help="metrics and final weights")
    p.add_argument("--save-final", action="store_true", help="write each rank's final parameters")
    p.add_argument("--cpu-autocast", action="store_true",
                   help="apply the plan's bf16/fp16 precision on CPU ranks too (default: fp32 on CPU)")
    p.add_argument("--timeout", type=positive_number("--timeout"),
                   default=float(os.environ.get("HETPLAN_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
                   help="seconds a collective or receive may wait for a peer before the run fails")
    p.add_argument("--weights", type=Path, default=None,
                   help="start from pretrained weights: a .safetensors file, a Hugging Face model folder or a "
                        "torch.distributed.checkpoint folder; each rank reads only its stage's tensors")
    p.add_argument("--data", type=Path, default=None,
                   help="the data file or folder the model file's dataset() reads (as HETPLAN_DATA)")
    p.add_argument("--no-device-check", action="store_true",
                   help="run on GPUs of another type than planned (the plan's times and memory do not hold)")
    p.add_argument("--fault", action="append", default=[], type=faults.parse,
                   help=f"inject a fault (tests and benchmarks; repeatable): {faults.FORMAT}")
    # rebalancing: re-solve the batch shares when replicas drift (rebalance.py)
    p.add_argument("--rebalance", action="store_true",
                   help="measure each replica's speed every step and move rows away from a replica that slowed "
                        "down, without a restart (rebalance.py)")
    # checkpoints and resume (checkpoint.py, checkpoint_state.py)
    p.add_argument("--checkpoint-every", type=count("--checkpoint-every", 0), default=0,
                   help="save a checkpoint (torch.distributed.checkpoint) every N steps (default 0: none)")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="where the checkpoints go, one step_<N> folder each (default: <--out>/ckpt)")
    p.add_argument("--keep-checkpoints", type=count("--keep-checkpoints", 1), default=checkpoint.DEFAULT_KEEP,
                   help="complete checkpoints kept; older ones are deleted once a new one completes")
    p.add_argument("--sync-checkpoint", action="store_true",
                   help="write checkpoints within the step (default: stage a copy, write in the background)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint under --checkpoint-dir (also done after "
                        "a restart by torchrun, when there is one)")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="continue from this checkpoint: a checkpoint folder (its latest complete step) or one "
                        "step_<N> folder, possibly of another plan of the same model")
    return p.parse_args(argv)


def start_stage(plan: Plan, ctx: process_group.Context, model_file: frontend.ModelFile, args: argparse.Namespace,
                ) -> tuple[stages.StageGraphs, dict[str, torch.nn.Parameter], dict[str, torch.Tensor],
                           dict[str, ShardSpec]]:
    """This rank's stage, ready to train: the model built and traced on meta at its replica's micro-batch
    sizes, and only this stage's tensors given values (the init contract, materialise.py) on its device.
    Returns the graphs, the stage's parameters and all its tensors (parameters and buffers) by name, and
    how each parameter tensor parallelism splits is cut (by name; none without it)."""
    meta = materialise.build_meta(model_file, args.seed)
    shards = tensor_parallel.Shards.of(ctx)            # None without tensor parallelism
    graphs = stages.StageGraphs(meta, model_file, [s.last_node for s in ctx.replica.stages],
                                ctx.replica.micro_batch_sizes, lambda rows: data.meta_inputs(model_file, rows),
                                ctx.device, shard=shards.shard_graph if shards else None)
    names = list(dict.fromkeys(name for st in ctx.stages for name in [*graphs.tensor_names(st.index), *st.params]))
    values = materialise.materialise(meta, names, ctx.device)
    if args.weights is not None:         # the checkpoint's values replace the contract's, name by name
        expected = weights.model_tensors(meta.module)
        weights.load_into(args.weights, {n: v for n, v in values.items() if n in expected},
                          weights.tied_aliases(meta.module), model_names=list(expected))
    if shards is not None:               # this rank's slice of each parameter the pairs split
        values = shards.shard_values(values)
    for st in ctx.stages:
        graphs.install(st.index, values)
    params = {name: values[name] for st in ctx.stages for name in st.params}
    cuts = {name: spec for name, spec in shards.specs().items() if name in values} if shards is not None else {}
    return graphs, {name: p for name, p in params.items() if isinstance(p, torch.nn.Parameter)}, values, cuts


def train(plan: Plan, place: placement.Placement, here: Path, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    ctx = process_group.init(plan, place, args.timeout)     # rank -> (replica, stage, device)
    try:
        _train(plan, ctx, here, args)
    except HetplanError:
        # refused together (a check's collective told every rank): leave the group before exiting, so
        # that no rank's exit tears down live communication threads (an abort instead of its exit code)
        gc.collect()
        dist.destroy_process_group()
        raise


def _train(plan: Plan, ctx: process_group.Context, here: Path, args: argparse.Namespace) -> None:
    rebalance.check_schedule(plan, args.rebalance)     # refused on every rank alike (plan run: before starting)
    if ctx.rank == 0:
        print(layout.table(plan), flush=True)
    functions = dict(plan.program.functions) if plan.program else {}
    if args.data is not None:
        os.environ[data.DATA_ENV] = str(args.data.resolve())
    model_file = frontend.load_model_file(here / "model.py", functions)
    graphs, params, tensors, cuts = start_stage(plan, ctx, model_file, args)
    rows = data.ReplicaData(model_file, plan, ctx.replica.index, ctx.device, seed=args.seed, steps=args.steps,
                            needs=data.stage_needs(graphs.split_at(graphs.sizes[0]), [st.index for st in ctx.stages],
                                                   ctx.is_last))
    faults.check_devices(args.fault, plan.devices)
    fault_set = faults.Faults(args.fault, plan.devices[ctx.rank])
    executor = pipeline.StageExecutor(plan, ctx, model_file, graphs, params, rows, cpu_autocast=args.cpu_autocast,
                                      drift=fault_set.slowdown)     # `slow` faults change the padding
    rebalancer = rebalance.Rebalancer(executor, seed=args.seed, steps=args.steps) if args.rebalance else None
    comm_check.check(plan, ctx, graphs, graphs.meta.module)   # only the verified communication
    grad_sync = gradsync.GradientSync(list(plan.grad_groups), ctx.grad_groups, executor.params)
    freeze_step = (optimizers.onebit_freeze_step(plan, args.steps) if args.onebit_freeze_step is None
                   else args.onebit_freeze_step)
    optimizer = optimizers.make_stage_optimizer(args.optimizer, executor.parameters(), grad_sync, args.lr,
                                                onebit_freeze_step=freeze_step,
                                                loss_scaling=executor.scaler is not None)
    # checkpoints and resume (checkpoint.py, checkpoint_state.py): the state restored in place, then saved
    state = _rank_state(plan, ctx, args, graphs, tensors, cuts, optimizer, grad_sync, executor.scaler)
    state.micro_batches = functools.partial(rebalance.micro_batches, executor)
    saver = _checkpointer(ctx, args, fault_set, state.plan_digest)
    first_step = _resume(ctx, args, state)
    if state.resumed_micro_batches is not None:      # the shares a checkpoint of this plan was taken with
        rebalance.resume_with(executor, state.resumed_micro_batches, seed=args.seed, steps=args.steps)
    log = metrics.MetricsLog(args.out, ctx)
    for step in range(first_step, args.steps):
        fault_set.before_step(step, saver.wait if saver else lambda: None)   # an injected `kill` dies here
        if saver is not None:
            saver.poll()                                    # rank 0 marks a finished background save complete
        start = time.perf_counter()
        executor.p2p.reset_counters()
        grad_sync.reset_counters()
        contribution = executor.train_step(step)            # schedule: forward/backward + p2p
        skipped = optimizers.sync_step_gradients(           # per gradient group, its compressor
            grad_sync, executor.parameters(), optimizer, executor.scaler)
        optimizers.optimizer_step(optimizer, executor.scaler)   # (skipped everywhere on fp16 overflow;
        optimizer.zero_grad(set_to_none=False)                  #  1-bit Adam exchanges momentum here)
        rebalanced = rebalancer.after_step(step) if rebalancer else {}   # new shares apply from the next step
        step_time_s = time.perf_counter() - start
        # a replica's shard lanes compute the same loss: lane 0's counts
        loss = torch.tensor([contribution if ctx.lane == 0 else 0.0], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(loss)                               # mean over the global batch
        by_group = grad_sync.step_wire_bytes_by_group()
        log.log(step=step, loss=float(loss), step_time_s=step_time_s,
                p2p_bytes=executor.p2p.bytes_sent, grad_bytes=grad_sync.step_grad_bytes(),
                grad_wire_bytes=sum(by_group.values()), grad_wire_bytes_by_group=by_group,
                compute_dtype=str(executor.compute_dtype).removeprefix("torch."),
                loss_scale=executor.scaler.scale if executor.scaler else None, skipped_step=skipped,
                compute_s=executor.slowdown.step_compute_s, compute_wall_s=executor.slowdown.step_compute_wall_s,
                **rebalanced)
        if saver is not None and saver.due(step + 1):       # the state after step + 1 completed steps
            saver.save(step + 1, checkpoint_state.collect(state, step + 1))
    if saver is not None:
        saver.close()                                       # the last save finished and marked
    log.close()
    if args.save_final:
        stages.save_parameters(executor.params, args.out / "final" / f"rank{ctx.rank}.pt")
    dist.barrier()
    executor.data.close()                                   # the rows of the last shares
    del executor, optimizer, grad_sync
    gc.collect()                                            # release gloo work before teardown
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- checkpoints and resume


def _rank_state(plan: Plan, ctx: process_group.Context, args: argparse.Namespace, graphs: stages.StageGraphs,
                tensors: dict[str, torch.Tensor], cuts: dict[str, ShardSpec], optimizer: torch.optim.Optimizer,
                grad_sync: gradsync.GradientSync, scaler: precision.LossScaler | None) -> checkpoint_state.RankState:
    """What a checkpoint of this rank holds, by the model's names (a tied tensor under one of them; a
    tensor-parallel shard under its name and shard, checkpoint_reshard.shard_name, and how it is cut)."""
    canonical = checkpoint_state.canonical_names(graphs.meta.module)
    full = {name: tuple(t.shape) for name, t in graphs.meta.module.state_dict(keep_vars=True).items()}

    def key(name: str, t: torch.Tensor) -> str:
        saved = canonical.get(name, name)
        if name in full and tuple(t.shape) != full[name]:      # this lane's slice of a split parameter
            return checkpoint_reshard.shard_name(saved, ctx.lane, ctx.stage.tp_degree)
        return saved
    return checkpoint_state.RankState(
        tensors={key(name, t): t for name, t in tensors.items()}, optimizer=optimizer,
        compressors=grad_sync.compressors(), scaler=scaler, rank=ctx.rank, device=ctx.device, seed=args.seed,
        optimizer_name=args.optimizer, plan_digest=checkpoint_state.plan_digest(plan),
        plan_compresses=any(g.compressor != "none" for g in plan.grad_groups),
        cuts={canonical.get(name, name): spec for name, spec in cuts.items()})


def _checkpoint_root(args: argparse.Namespace) -> Path:
    return args.checkpoint_dir if args.checkpoint_dir is not None else args.out / checkpoint.CHECKPOINT_DIR


def _checkpointer(ctx: process_group.Context, args: argparse.Namespace, fault_set: faults.Faults,
                  plan_digest: str) -> checkpoint_save.Checkpointer | None:
    """The saver of --checkpoint-every (None without it); every rank makes one at the same point."""
    if not args.checkpoint_every:
        return None
    from . import checkpoint_save  # DCP, only for a run that saves (checkpoint.py says why)

    return checkpoint_save.Checkpointer(_checkpoint_root(args), args.checkpoint_every, rank=ctx.rank,
                                        world_size=ctx.world_size, plan_digest=plan_digest,
                                        keep=args.keep_checkpoints, synchronous=args.sync_checkpoint,
                                        timeout_s=args.timeout, during_save=fault_set.during_save)


def _resume(ctx: process_group.Context, args: argparse.Namespace, state: checkpoint_state.RankState) -> int:
    """The first step to run: 0, or that of the checkpoint resumed from (checkpoint.resume_folder),
    after loading it into `state`. Every rank must have chosen the same one (checked by one all-reduce)."""
    restarts = int(os.environ.get(faults.RESTART_ENV, "0") or 0)
    if not (args.resume or args.resume_from is not None or restarts > 0):
        return 0
    folder = checkpoint.resume_folder(_checkpoint_root(args), resume=args.resume, resume_from=args.resume_from,
                                      restart_count=restarts)
    chosen = checkpoint.step_of(folder) if folder is not None else -1
    seen = torch.tensor([chosen, -chosen], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if int(seen[0]) != -int(seen[1]):
        raise checkpoint.CheckpointError(f"the ranks chose different checkpoints to resume from (steps "
                                         f"{-int(seen[1])} to {int(seen[0])}); this rank chose {chosen}",
                                         file=str(folder or _checkpoint_root(args)),
                                         fix="give every node the same --checkpoint-dir (a shared folder)")
    if folder is None:
        return 0
    first_step = checkpoint_state.restore(folder, state, keep_freeze_step=args.onebit_freeze_step is not None)
    if ctx.rank == 0:
        print(f"train.py: resumed from {folder} at step {first_step}", flush=True)
    return first_step


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    place: placement.Placement | None = None
    plan: Plan | None = None
    limit: memory.DataLimit | None = None
    try:
        plan = Plan.load(here / "plan.json")
        args = parse_args(plan, here, argv)
        place = placement.resolve(plan)
        if not args.no_device_check:
            placement.check_gpu(plan, place)
        limit = memory.emulate_device_memory(plan, place.rank, _device_of(plan, place))
        train(plan, place, here, args)
    except (HetplanError, MemoryError, dist.DistError, RuntimeError) as exc:
        failed = memory.allocation_failure(exc)
        if failed is not None and plan is not None and place is not None:
            return _out_of_memory(plan, place, limit, failed)
        if isinstance(exc, HetplanError):
            # a wrong launch or argument is seen alike by every process of an agent: its first one says so, once
            if not isinstance(exc, (placement.LaunchError, OptionError)) or os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"train.py: {exc.one_line()}", file=sys.stderr, flush=True)
            if exc.exit_code == process_group.FOR_PEER_EXIT_CODE:
                time.sleep(process_group.FOR_PEER_EXIT_DELAY_S)   # the rank that failed is seen first
            return exc.exit_code
        if not isinstance(exc, dist.DistError) and "gloo" not in str(exc):
            raise                   # not communication: the traceback is the report
        # a peer died or hung (gloo reports a timeout or a closed connection as a RuntimeError): the
        # launcher names the rank; this one says what it saw, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        rank = place.rank if place is not None else os.environ.get("RANK", "?")
        print(f"train.py: rank {rank}: {type(exc).__name__}: {first[:300]}", file=sys.stderr, flush=True)
        time.sleep(process_group.FOR_PEER_EXIT_DELAY_S)           # the rank that failed is seen first
        return process_group.FOR_PEER_EXIT_CODE
    return 0


def _out_of_memory(plan: Plan, place: placement.Placement, limit: memory.DataLimit | None,
                   failed: BaseException) -> int:
    """Say in one line that this rank ran out of memory (memory.out_of_memory); the exit code."""
    if limit is not None:
        limit.lift()                # the report needs a little memory of its own
    error = memory.out_of_memory(plan, place.rank, _device_of(plan, place), failed)
    print(f"train.py: {error.one_line()}", file=sys.stderr, flush=True)
    return error.exit_code


def _device_of(plan: Plan, place: placement.Placement) -> torch.device:
    """The device the rank of `place` computes on (as process_group.init chooses it)."""
    stage = plan.stage_of_rank(place.rank)[1]
    return torch.device("cuda", place.device_index) if placement.uses_cuda(stage) else torch.device("cpu")


if __name__ == "__main__":
    sys.exit(main())
