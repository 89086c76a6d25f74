"""The plan's communication and stage checks, and the trace they need made ahead, beside the first one.

Both checks run on the model traced at each micro-batch size of the plan (passes.comm.inputs.trace_splits),
and a large model trains in micro-batches of one row: for Llama-2-70B on 1024 GPUs that trace (about 1 s)
came after the search, on the critical path, while the host's second core sat idle through the first
trace. So where the model's training state does not fit the cluster's largest device (micro-batches of
one row likely: `worth_tracing_ahead`), a forked child traces it at one row while this process traces at
the planner's batch (core.forked.forked_until), then waits for the plan and runs both checks there: the
stage splits, each distinct stage's forward and backward on meta (passes.stage_check), and the verifier in
a child of its own. A plan without one-row micro-batches stops the child and runs the checks here, as does
a caller that must not fork; the record and the errors are the same either way.

The child runs torch, which core.forked otherwise keeps out of children: its work is on meta tensors (no
kernel runs), the one real operation being the model file's batch() of one row, and its intra-op threads
are set to one before it, so it never waits on the OpenMP pool the fork left behind. What it prints goes
nowhere (the trace at the planner's batch printed the same here), and an error of its trace reaches the
plan only if the plan has one-row micro-batches.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.fx as fx

from passes.comm import verify_comm
from passes.comm.inputs import trace_splits, traced_inputs
from passes.stage_check import check_plan_stages
from planner import frontend
from planner.core.cluster import ClusterSpec
from planner.core.comm_records import CommRecord
from planner.core.forked import Waiting, forked, forked_until
from planner.core.ir import Plan
from planner.frontend.model_file import build_on_meta

AHEAD_ROWS = 1                   # the micro-batch size traced ahead
TRAINING_BYTES_PER_PARAMETER = 16    # fp32 weight, gradient and Adam's two moments: whole-model training state
# how long a forked step (the runners-up, the checks, the verifier) may go without a result before it is
# killed and made here instead (core.forked): 100x what each takes for Llama-2-70B on 1024 GPUs
CHILD_WAIT_S = 120.0


def worth_tracing_ahead(model_file: frontend.ModelFile, spec: ClusterSpec) -> bool:
    """Whether the model's whole training state exceeds the memory of the cluster's largest device: the
    plan then cuts it into stages, whose micro-batches are most often one row."""
    module = build_on_meta(model_file)
    state_bytes = sum(p.numel() for p in module.parameters()) * TRAINING_BYTES_PER_PARAMETER
    return state_bytes > max((g.device.memory_bytes for g in spec.nodes), default=0)


def traced_ahead(model_file: frontend.ModelFile, spec: ClusterSpec,
                 fork: bool) -> AbstractContextManager[Waiting[fx.GraphModule, Plan, CommRecord] | None]:
    """A child tracing the model at AHEAD_ROWS and then checking the plan it is sent (`checked_comm`), or
    None where it is not worth a child (`worth_tracing_ahead`) or the caller must not fork."""
    if not (fork and worth_tracing_ahead(model_file, spec)):
        return nullcontext()

    def prepare() -> fx.GraphModule:
        torch.set_num_threads(1)     # a forked child has none of the parent's intra-op threads
        return frontend.trace_model(model_file, AHEAD_ROWS)[0]

    def finish(gm: fx.GraphModule, plan: Plan) -> CommRecord:
        return checked_comm(plan, model_file, gm, AHEAD_ROWS, fork=True)

    return forked_until(prepare, finish, fork)


def uses_ahead_rows(plan: Plan) -> bool:
    return any(AHEAD_ROWS in r.micro_batch_sizes for r in plan.replicas)


def checked_comm(plan: Plan, model_file: frontend.ModelFile, gm: fx.GraphModule, rows: int,
                 fork: bool) -> CommRecord:
    """The plan's `comm` record (passes.comm.verify_comm) after every distinct stage of its splits ran once
    on meta (passes.stage_check); `gm` is the model traced at `rows`, the other sizes are traced here. The
    verifier (pure Python) runs in a forked child while the stages run (torch's work stays here)."""
    splits = trace_splits(plan, model_file, gm, rows)
    streams = traced_inputs(plan, splits, gm)
    with forked(lambda: verify_comm(plan, streams), fork) as verifying:
        check_plan_stages(splits, model_file)
        return verifying.result(CHILD_WAIT_S)
