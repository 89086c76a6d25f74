"""Rebalancing the batch shares when replicas drift (train.py --rebalance), without a restart.

A heterogeneous plan's uneven shares balance the replicas' speeds as planned; a device that slows down
later (thermal limits, a noisy neighbour) leaves its replica the slowest and the others waiting. Every
step, after the optimizer step:

1. measure: each rank's compute seconds of the step (slowdown.Slowdown.step_compute_s: its own work,
   padding included, not the time blocked in receives); one all-reduce of a float64 tensor of world
   size tells every rank every rank's figure, so every rank decides alike. Logged per replica: its
   slowest stage's compute seconds per row (a pipeline runs at its slowest stage's pace).
2. decide: the robust figure is each rank's median over the last WINDOW_STEPS steps (the first
   WARMUP_STEPS, and the steps before the last change, not counted). A stage's step is part per row,
   part per micro-batch (launches, framework work: most of a small micro-batch's time), and one step's
   total cannot tell the two apart; the plan's cost model can (StagePlan: seconds per sample and per
   micro-batch), so the measured total over the planned total scales both (`speeds_of`). The share
   solver (planner.search.rebalance: it sees only numbers) then predicts the slowest replica's step
   time on the current shares and on the best ones; when the current exceed the best by more than
   THRESHOLD for PATIENCE_STEPS consecutive steps, the best shares are the new ones.
   Memory bounds both (`max_rows`, `fitting_micro_batches`): a GPipe replica keeps its micro-batch size
   and at most its planned count (GPipe holds every micro-batch's activations; the plan proved only
   those fit). A 1F1B stage holds at most S - s micro-batches whatever the count, so its rows are not
   bounded, and it may also run another of the planner's micro-batch sizes (planner.search.configs)
   where the plan's estimate of its memory, with the activations of S - s micro-batches of the new
   size in place of the planned ones, still fits its device (costmodel.memory's rule and margin).
3. verify: the new Plan (dataclasses.replace of the replicas' batch_share and micro_batch_sizes, cut
   by the planner's rule) is checked as `plan` checks one: every rank traces the model on meta at the
   new plan's micro-batch sizes and runs the planner's verifier on every rank's communication
   (passes.comm.verify_comm), then checks that its own stage split derives the verified stream
   (comm_check.mismatch on the new graphs); one all-reduce of a flag per rank makes the ranks agree.
   Refused anywhere: every rank keeps the old shares, and the record says why.
4. apply from the next step: the executor takes the new plan, its stage graphs at the new sizes (traced
   on meta, this rank's own tensors installed again: the same Parameter objects, so the optimizer, the
   gradient sync and their state stay) and a new data.ReplicaData, whose micro_batches(step) starts at
   any step.

Losses are weighted by rows / global batch and gradients summed, so training stays equal to one process
whatever the shares. Each rebalance is a `rebalance` record on the step's metrics line (metrics.
RebalanceRecord) and one line on rank 0's stdout.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from costmodel import memory as cost_memory
from passes import comm
from passes.comm.inputs import model_params, split_inputs
from passes.split import attr_name
from planner import frontend
from planner.core.errors import HetplanError, OptionError
from planner.core.ir import Plan, StagePlan
from planner.search.configs import micro_batch_options
from planner.search.rebalance import ReplicaSpeed, Shares, micro_batch_sizes, slowest_s, solve_shares

from . import comm_check, data
from .materialise import MetaModel
from .metrics import RebalanceRecord
from .pipeline import StageExecutor
from .stages import StageGraphs

THRESHOLD = 0.10       # the current shares' predicted slowest step may exceed the best by this fraction
PATIENCE_STEPS = 3     # consecutive steps over the threshold before the shares are re-solved
WINDOW_STEPS = 5       # the robust figure: the median of a replica's figures over this many steps
WARMUP_STEPS = 1       # the first steps' figures (first-touch allocation, lazy initialisation, the first
                       # at new sizes; also after a resume) are not used


def stage_compute_s(stage: StagePlan, rank_compute_s: list[float]) -> float:
    """A stage's measured compute seconds: its slowest shard's (the shards' all-reduces pace them alike)."""
    return max(rank_compute_s[rank] for rank in stage.ranks)


def replica_s_per_row(plan: Plan, rank_compute_s: list[float]) -> list[float]:
    """Per replica, its slowest stage's measured compute seconds per row of its share."""
    return [max(stage_compute_s(st, rank_compute_s) for st in r.stages) / r.batch_share for r in plan.replicas]


def planned_compute_s(stage: StagePlan, micro_batch_sizes: tuple[int, ...]) -> float:
    """A stage's compute in one step by the plan's cost model: per row, and per micro-batch."""
    per_row_s = stage.fwd_s_per_sample + stage.bwd_s_per_sample
    return per_row_s * sum(micro_batch_sizes) + stage.overhead_s * len(micro_batch_sizes)


def stage_activation_bytes(plan: Plan, stage: StagePlan, micro_batch: int, in_flight: int) -> float:
    """The activations a stage holds at its peak with `in_flight` micro-batches of `micro_batch` rows, as the
    planner's cost tables count them (costmodel.memory.stage_activation_figures and kept_activation_bytes)."""
    kept, stage_input, working = cost_memory.stage_activation_figures(plan.blocks, stage.first_block, stage.last_block,
                                                                      stage.precision, plan.inputs.trace_batch)
    return cost_memory.kept_activation_bytes(kept, stage_input, working, micro_batch, in_flight, stage.recompute)


def fitting_micro_batches(plan: Plan, replica_index: int) -> tuple[int, ...]:
    """The planner's micro-batch sizes a replica may run instead of its own (the module docstring's
    memory rule): none under GPipe or recompute, whose memory the plan fixes at its planned sizes."""
    replica = plan.replicas[replica_index]
    if replica.schedule == "gpipe" or any(st.recompute for st in replica.stages):
        return ()
    planned, count, depth = max(replica.micro_batch_sizes), len(replica.micro_batch_sizes), len(replica.stages)
    out = []
    for size in micro_batch_options(plan.global_batch):
        fits = True
        for st in replica.stages:      # the new size's count may hold S - s (ZB-H1: S), whatever the planned one
            held_now = cost_memory.in_flight_micro_batches(replica.schedule, st.index, depth, count)
            held_then = cost_memory.in_flight_micro_batches(replica.schedule, st.index, depth, depth)
            need = plan.estimates.memory_bytes[st.rank] + (stage_activation_bytes(plan, st, size, held_then) -
                                                           stage_activation_bytes(plan, st, planned, held_now))
            usable = cost_memory.capacity_bytes(plan.estimates.capacity_bytes[st.rank], plan.estimates.memory_margin)
            fits &= bool(cost_memory.fits(need, usable))
        if fits and size != planned:
            out.append(size)
    return tuple(out)


def max_rows(plan: Plan, replica_index: int) -> int | None:
    """The most rows a replica may take (the module docstring's memory rule; None: no limit)."""
    replica = plan.replicas[replica_index]
    if replica.schedule != "gpipe":
        return None
    return len(replica.micro_batch_sizes) * max(replica.micro_batch_sizes)


def speeds_of(plan: Plan, rank_compute_s: list[float], planned: Plan | None = None) -> list[ReplicaSpeed]:
    """The solver's view of each replica of `plan` from each rank's measured compute seconds of a step:
    per stage the plan's seconds per row and per micro-batch, both scaled by measured over planned (a
    stage the plan costs at nothing: all of it per row), its slowest stage's of each; its micro-batch
    size, depth, and the memory rule's bounds, taken from the plan as planned (`planned`, default
    `plan`: its memory estimates are the planner's, for its own shares)."""
    planned = planned or plan
    speeds = []
    for r in plan.replicas:
        per_row_s, per_micro_s = 0.0, 0.0
        for st in r.stages:
            measured_s, planned_s = stage_compute_s(st, rank_compute_s), planned_compute_s(st, r.micro_batch_sizes)
            if planned_s > 0.0:
                scale = measured_s / planned_s
                per_row_s = max(per_row_s, scale * (st.fwd_s_per_sample + st.bwd_s_per_sample))
                per_micro_s = max(per_micro_s, scale * st.overhead_s)
            else:
                per_row_s = max(per_row_s, measured_s / r.batch_share)
        others = (*fitting_micro_batches(planned, r.index), max(planned.replicas[r.index].micro_batch_sizes))
        speeds.append(ReplicaSpeed(per_row_s, max(r.micro_batch_sizes), len(r.stages), max_rows(planned, r.index),
                                   seconds_per_micro_batch=per_micro_s, other_micro_batches=others))
    return speeds


def reshare(plan: Plan, shares: tuple[int, ...], micro_batches: tuple[int, ...] | None = None) -> Plan:
    """`plan` with these batch shares, each cut into micro-batches of the replica's size in
    `micro_batches` (default: its planned one) by the planner's rule; stages, devices and schedules as
    they are (its `comm` record: the old one until verified again)."""
    sizes = micro_batches or tuple(max(r.micro_batch_sizes) for r in plan.replicas)
    return with_micro_batches(plan, tuple(micro_batch_sizes(rows, size)
                                          for rows, size in zip(shares, sizes, strict=True)))


def verified(plan: Plan, meta: MetaModel, model_file: frontend.ModelFile) -> Plan:
    """`plan` with the `comm` record of its communication proved free of deadlock, as `plan` makes it:
    the model traced on meta at each micro-batch size, split like each replica (PassError: not verified)."""
    def graph_at(rows: int) -> fx.GraphModule:
        return frontend.trace(meta.module, data.meta_inputs(model_file, rows), file=str(model_file.path),
                              replicate_repeated=True)

    grouped = {p for g in plan.grad_groups for p in g.params}
    params = {k: v for k, v in model_params(meta.module).items() if k in grouped}
    inputs = split_inputs(plan, graph_at, params)
    return dataclasses.replace(plan, comm=comm.verify_comm(plan, inputs))


def regraph(old: StageGraphs, stage: int, sizes: tuple[int, ...], model_file: frontend.ModelFile,
            device: torch.device) -> StageGraphs:
    """This stage's graphs at `sizes`, with the tensors installed in `old` (the same objects): `old`
    itself when it has every size already."""
    if set(sizes) <= set(old.sizes):
        return old
    graphs = StageGraphs(old.meta, old.model_file, old.last_nodes, sizes,
                         lambda rows: data.meta_inputs(model_file, rows), device, shard=old.shard)
    installed: dict[str, torch.Tensor] = {}
    for rows in old.sizes:
        module = old.split_at(rows).stages[stage].module
        for name in graphs.tensor_names(stage):
            if name not in installed and hasattr(module, attr_name(name)):
                installed[name] = getattr(module, attr_name(name))
    missing = [n for n in graphs.tensor_names(stage) if n not in installed]
    if missing:
        raise comm_check.StreamMismatch(f"stage {stage} at micro-batch sizes {sizes} reads {missing[0]}, which "
                                        "it does not read at its planned sizes", field="replicas",
                                        fix="run without --rebalance")
    graphs.install(stage, installed)
    return graphs


def agree(why: str | None, rank: int, world_size: int, device: torch.device) -> str | None:
    """One all-reduce of a flag per rank: why this rank refuses (`why`), or, where it does not but another
    does, a line naming that one; None when no rank refuses. Every rank thus refuses or applies alike."""
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = int(why is not None)
    dist.all_reduce(flags)
    refusing = [r for r, flag in enumerate(flags.tolist()) if flag]
    if refusing and why is None:
        return f"rank {refusing[0]} could not verify the new shares' communication (its log says why)"
    return why


@dataclass(frozen=True)
class Proposal:
    """New shares the measured figures call for."""

    shares: Shares                  # the best shares and their predicted slowest step
    speeds: list[ReplicaSpeed]      # per replica, what they were solved from (the robust figures)
    current_s: float                # the predicted slowest step on the current shares


class Trigger:
    """When to re-solve (the module docstring's step 2), from the figures alone: `observe` each step's
    compute seconds per rank; it proposes new shares after `patience_steps` consecutive steps whose window
    medians predict the current shares more than `threshold` slower than the best."""

    def __init__(self, threshold: float = THRESHOLD, patience_steps: int = PATIENCE_STEPS,
                 window_steps: int = WINDOW_STEPS, warmup_steps: int = WARMUP_STEPS) -> None:
        self.threshold, self.patience_steps, self.warmup_steps = threshold, patience_steps, warmup_steps
        self.window: deque[list[float]] = deque(maxlen=window_steps)
        self.over_steps = 0
        self.seen_steps = 0

    def observe(self, plan: Plan, rank_compute_s: list[float], planned: Plan | None = None) -> Proposal | None:
        """A step's compute seconds per rank under `plan` (`planned`: the plan as planned, for the memory
        rule; default `plan`); new shares when they are due."""
        self.seen_steps += 1
        if self.seen_steps <= self.warmup_steps:
            return None
        self.window.append(rank_compute_s)
        if len(self.window) < (self.window.maxlen or 1):
            return None
        robust = [statistics.median(column) for column in zip(*self.window)]
        speeds = speeds_of(plan, robust, planned)
        best = solve_shares(speeds, plan.global_batch)
        current = tuple(r.batch_share for r in plan.replicas)
        current_s = slowest_s(speeds, current)
        self.over_steps = self.over_steps + 1 if current_s > (1.0 + self.threshold) * best.slowest_s else 0
        if self.over_steps < self.patience_steps or best.rows == current:
            return None
        return Proposal(best, speeds, current_s)

    def reset(self) -> None:
        """Start anew (after a change: the window's figures were measured on the old shares)."""
        self.window.clear()
        self.over_steps = 0
        self.seen_steps = 0


class Rebalancer:
    """This rank's part in rebalancing (the module docstring): `after_step(step)` once per step, on every
    rank, after the optimizer step. `seed` and `steps` as the run's data.ReplicaData was made with."""

    def __init__(self, executor: StageExecutor, *, seed: int, steps: int | None,
                 trigger: Trigger | None = None) -> None:
        self.executor, self.seed, self.steps = executor, seed, steps
        self.trigger = trigger or Trigger()
        self.planned = executor.plan        # its memory estimates bound every later plan's micro-batches

    def after_step(self, step: int) -> dict[str, Any]:
        """Measure, decide and perhaps apply new shares from step + 1; the metrics line's fields."""
        plan, ctx = self.executor.plan, self.executor.ctx
        mine = torch.zeros(plan.world_size, dtype=torch.float64, device=ctx.device)
        mine[ctx.rank] = self.executor.slowdown.step_compute_s
        dist.all_reduce(mine)                       # every rank's figure on every rank
        compute_s = mine.tolist()
        fields: dict[str, Any] = {"replica_s_per_row": replica_s_per_row(plan, compute_s)}
        proposal = self.trigger.observe(plan, compute_s, self.planned)
        if proposal is None:
            return fields
        record = self._apply(step, proposal)
        self.trigger.reset()
        if ctx.rank == 0:
            what = "applied from the next step" if record.applied else f"refused: {record.refused}"
            micro = ", ".join(f"{list(sizes)}" for sizes in record.new_micro_batch_sizes)
            print(f"rebalance after step {step}: shares {list(record.old_shares)} -> {list(record.new_shares)} "
                  f"(micro-batches {micro}; "
                  f"seconds per row {', '.join(f'{s:.3g}' for s in record.seconds_per_row)}; predicted step "
                  f"{record.predicted_old_s:.4g} s -> {record.predicted_new_s:.4g} s): {what}", flush=True)
        return {**fields, **record.fields()}

    def _apply(self, step: int, proposal: Proposal) -> RebalanceRecord:
        """Verify the new shares everywhere; apply them on every rank, or on none (the record says why)."""
        plan = self.executor.plan
        proposed = reshare(plan, proposal.shares.rows, proposal.shares.micro_batches)
        why = switch(self.executor, proposed, seed=self.seed, steps=self.steps)
        return RebalanceRecord(
            step=step, old_shares=tuple(r.batch_share for r in plan.replicas), new_shares=proposal.shares.rows,
            new_micro_batch_sizes=tuple(r.micro_batch_sizes for r in proposed.replicas),
            seconds_per_row=tuple(s.seconds_per_row for s in proposal.speeds),
            seconds_per_micro_batch=tuple(s.seconds_per_micro_batch for s in proposal.speeds),
            predicted_old_s=proposal.current_s, predicted_new_s=proposal.shares.slowest_s,
            applied=why is None, refused=why)


def with_micro_batches(plan: Plan, sizes: tuple[tuple[int, ...], ...]) -> Plan:
    """`plan` with each replica's micro-batches (and so its share) as `sizes` says, replica by replica."""
    replicas = tuple(dataclasses.replace(r, batch_share=sum(rows), micro_batch_sizes=rows)
                     for r, rows in zip(plan.replicas, sizes, strict=True))
    return dataclasses.replace(plan, replicas=replicas)


def switch(executor: StageExecutor, plan: Plan, *, seed: int, steps: int | None) -> str | None:
    """Run the next steps by `plan` (the executor's, with other shares and micro-batches) on every rank, or
    on none: verified as `plan` verifies one (step 3 of the module docstring), then applied (step 4).
    Returns why it was refused, or None where it applies. Every rank calls it alike."""
    ctx, meta = executor.ctx, executor.graphs.meta
    why = None
    try:
        new_plan = verified(plan, meta, executor.model_file)
        new_ctx = dataclasses.replace(ctx, replica=new_plan.replicas[ctx.replica.index])
        graphs = regraph(executor.graphs, ctx.stage.index, new_ctx.replica.micro_batch_sizes,
                         executor.model_file, ctx.device)
        why = comm_check.mismatch(new_plan, ctx.rank, comm_check.own_inputs(new_ctx, graphs, meta.module))
    except HetplanError as exc:
        why = f"rank {ctx.rank}: {exc.message}"
    why = agree(why, ctx.rank, executor.plan.world_size, ctx.device)     # refused anywhere: refused everywhere
    if why is None:
        rows = data.ReplicaData(executor.model_file, new_plan, ctx.replica.index, ctx.device,
                                needs=executor.data.needs, seed=seed, steps=steps)
        executor.replace_plan(new_plan, new_ctx, graphs, rows)
    return why


def micro_batches(executor: StageExecutor) -> tuple[tuple[int, ...], ...]:
    """Each replica's micro-batch sizes the run trains with now (a rebalance changes the plan's)."""
    return tuple(r.micro_batch_sizes for r in executor.plan.replicas)


def resume_with(executor: StageExecutor, saved: tuple[tuple[int, ...], ...], *, seed: int,
                steps: int | None) -> None:
    """A checkpoint of this plan taken after a rebalance: train on with the micro-batches (so the shares) it
    was taken with, switched to as a rebalance switches, so the run continues as it would have, bit for bit."""
    if saved == micro_batches(executor):
        return
    why = switch(executor, with_micro_batches(executor.plan, saved), seed=seed, steps=steps)
    if executor.ctx.rank == 0:
        shares = [sum(sizes) for sizes in saved]
        print(f"train.py: resumed with the shares {shares} the checkpoint was taken with" if why is None else
              f"train.py: warning: the checkpoint's shares {shares} were refused ({why}): the plan's shares",
              flush=True)


def check_schedule(plan: Plan, rebalance: bool) -> None:
    """`--rebalance` on a plan with interleaved 1F1B, which it does not run yet: one line (OptionError)."""
    interleaved = [r.index for r in plan.replicas if r.chunks > 1]
    if interleaved and rebalance:
        raise OptionError(f"--rebalance is not supported yet for a plan with interleaved 1F1B (replicas "
                          f"{interleaved}): new micro-batch counts must fill whole rounds of the schedule",
                          field="--rebalance", fix="run without --rebalance, or re-plan with --schedule 1f1b")
