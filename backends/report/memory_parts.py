"""What a rank's estimated memory is made of, derived from the plan the way the search costed it.

Weights, gradients and optimizer state from the stage's parameters (costmodel.memory.state_bytes'
factors), activations from its blocks, micro-batch, schedule and recompute (the search's rule,
planner.search.split.kept_activation_bytes, on the plan's per-block figures); the rest of what the
plan records for the rank is the framework's share (datasheet or calibrated, as the plan was made)
where the rank is in no compressed gradient group, and else the framework's datasheet share plus the
compressor state (error feedback, PowerSGD's factors) as the rest. Used by the HTML report's bars.
"""

from __future__ import annotations

from costmodel import constants as C
from costmodel import memory
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan


def memory_parts(plan: Plan, rank: int, spec: ClusterSpec | None) -> tuple[float, ...]:
    """(weights, gradients, optimizer state, activations, compressor state, framework) in bytes."""
    replica, stage = plan.stage_of_rank(rank)
    blocks = plan.blocks[stage.first_block: stage.last_block + 1]
    params_fp32 = sum(b.param_bytes for b in blocks)
    weights = params_fp32 * (1.0 + (C.MIXED_PRECISION_WEIGHT_COPY_FACTOR if stage.precision != "fp32" else 0.0))
    gradients = params_fp32
    optimizer = params_fp32 * (C.ADAMW_STATE_FACTOR - 2.0)      # AdamW's two moments
    micro = max(replica.micro_batch_sizes)
    in_flight = memory.in_flight_micro_batches(replica.schedule, stage.index, len(replica.stages),
                                               len(replica.micro_batch_sizes))
    kept, stage_input, working = memory.stage_activation_figures(plan.blocks, stage.first_block, stage.last_block,
                                                                 stage.precision, plan.inputs.trace_batch)
    activations = memory.kept_activation_bytes(kept, stage_input, working, micro, in_flight, stage.recompute)
    rest = max(plan.estimates.memory_bytes[rank] - (weights + gradients + optimizer + activations), 0.0)
    compressed = any(rank in g.ranks and g.compressor != "none" for g in plan.grad_groups)
    if not compressed or spec is None or stage.device >= spec.num_devices:
        return weights, gradients, optimizer, activations, 0.0, rest
    framework = min(memory.framework_bytes(spec.devices()[stage.device].type), rest)
    return weights, gradients, optimizer, activations, rest - framework, framework
