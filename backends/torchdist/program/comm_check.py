"""Run only the communication that was verified: at start-up every rank derives its own streams (every
run variant) from its own stage split, with the planner's function (passes.comm), and compares their
digest with the one the plan recorded when `plan` proved all ranks' streams free of deadlock
(`plan.comm`). Then one all-reduce over all ranks tells each whether any rank differs, so that all stop
together, before the first step, each with one line: the rank that differs names its first differing
event (derived again from the recorded splits), the others name that rank.

A stream differs when this rank's split is not the planner's (another model file, another torch, a
changed trace) or the plan was edited; either would run communication nobody checked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from passes import comm
from passes.comm.inputs import SplitView, StreamInputs, model_params
from planner.core.errors import HetplanError, PlanFileError
from planner.core.ir import Plan

from .process_group import FOR_PEER_EXIT_CODE, Context
from .stages import StageGraphs

FIX = "re-plan with this model file and this hetplan, and run the program `plan` wrote; do not edit plan.json"


class StreamMismatch(PlanFileError):
    """This rank's communication is not the one verified at planning."""


class PeerMismatch(StreamMismatch):
    """Another rank's communication is not the verified one: this one stops with it."""

    exit_code = FOR_PEER_EXIT_CODE


def own_inputs(ctx: Context, graphs: StageGraphs, model: nn.Module) -> StreamInputs:
    """This rank's StreamInputs: its replica's split at each micro-batch size, as it will run them
    (`model`: the model on meta, for its parameters' sizes)."""
    splits = {(ctx.replica.index, rows): SplitView.of(graphs.split_at(rows)) for rows in graphs.sizes}
    return StreamInputs(splits, model_params(model))


def mismatch(plan: Plan, rank: int, mine: StreamInputs) -> str | None:
    """Why `rank`'s streams from `mine` are not the verified ones, in one line; None when they are."""
    if plan.comm is None:
        return (f"rank {rank}: the plan records no verified communication (`comm`: a plan from an earlier "
                "hetplan, or not made by `plan`)")
    if len(plan.comm.digests) != plan.world_size:
        return f"rank {rank}: the plan records {len(plan.comm.digests)} stream digests for {plan.world_size} ranks"
    digest, streams = comm.rank_digest(plan, rank, mine)
    recorded = plan.comm.digests[rank]
    if digest == recorded:
        return None
    try:
        _, verified = comm.rank_digest(plan, rank, comm.from_record(plan.comm))
    except HetplanError as exc:
        return f"rank {rank}: the plan's record of its streams is incomplete: {exc.message}"
    found = comm.first_difference(streams, verified)
    if found is None:
        return (f"rank {rank}: its streams are the ones the plan records, but not their recorded digest "
                f"{recorded} ({digest} here)")
    variant, position, here, there = found
    return (f"rank {rank}: its communication differs from the verified one at event {position} of a step "
            f"with {variant.name}: `{here}` here, `{there}` verified")


def check(plan: Plan, ctx: Context, graphs: StageGraphs, model: nn.Module) -> None:
    """Refuse unless every rank's streams are the verified ones, on every rank: StreamMismatch where they
    differ, PeerMismatch on the others."""
    try:
        why = mismatch(plan, ctx.rank, own_inputs(ctx, graphs, model))
    except HetplanError as exc:     # e.g. a group's parameter this model does not have
        why = f"rank {ctx.rank}: cannot derive its communication: {exc.message}"
    flags = torch.zeros(plan.world_size, dtype=torch.int32, device=ctx.device)
    flags[ctx.rank] = int(why is not None)
    dist.all_reduce(flags)          # the stream's `check` event: every rank learns who differs
    if why is not None:
        raise StreamMismatch(why, file="plan.json", field="comm", fix=FIX)
    differ = [r for r, flag in enumerate(flags.tolist()) if flag]
    if differ:
        which = (f"rank {differ[0]} is not the verified one (its log says" if len(differ) == 1 else
                 f"ranks {', '.join(map(str, differ))} are not the verified one (their logs say")
        raise PeerMismatch(f"rank {ctx.rank}: not starting: the communication of {which} where)",
                             file="plan.json", field="comm", fix=FIX)
