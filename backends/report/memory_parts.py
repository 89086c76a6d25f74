"""What a rank's estimated memory is made of, as the search priced it. Used by the HTML report's bars.

A plan records, per stage, the training state its rank holds (weights, gradients and optimizer state, as
tensor parallelism and ZeRO shard them; under interleaved 1F1B its device's stages together), the optimizer
state's part of it and the activations kept at the schedule's peak (planner.search.assemble); the rest of
the stage's need is the framework's, and what the rank's recorded memory adds to it is its gradient
compressors' state (error feedback, PowerSGD's factors). Weights and gradients split the state's remainder
by costmodel.memory.state_bytes' factors (fp32 gradients, weights with their low-precision copy under
mixed precision).

A plan written before those records were kept gets the search's rules on its per-block figures instead,
exact for a stage without tensor parallelism, ZeRO or interleaving, the framework's share taken as the rest.
"""

from __future__ import annotations

from costmodel import constants as C
from costmodel import memory
from costmodel.sharded_state import ADAMW_MOMENT_FACTOR
from planner.core.cluster import ClusterSpec
from planner.core.ir import Plan

Parts = tuple[float, float, float, float, float, float]


def memory_parts(plan: Plan, rank: int, spec: ClusterSpec | None) -> Parts:
    """(weights, gradients, optimizer state, activations, compressor state, framework) in bytes."""
    _, stage = plan.stage_of_rank(rank)
    if stage.state_bytes <= 0.0:
        return _derived_parts(plan, rank, spec)
    weights_and_gradients = stage.state_bytes - stage.optimizer_bytes
    # per fp32 parameter byte: a gradient, and the weights (with their low-precision copy)
    gradients = weights_and_gradients / (memory.state_bytes(1.0, stage.precision) - ADAMW_MOMENT_FACTOR)
    framework = stage.memory_bytes - stage.state_bytes - stage.activation_bytes
    compressor = plan.estimates.memory_bytes[rank] - stage.memory_bytes
    return (weights_and_gradients - gradients, gradients, stage.optimizer_bytes, stage.activation_bytes,
            compressor, framework)


def _derived_parts(plan: Plan, rank: int, spec: ClusterSpec | None) -> Parts:
    """The parts of a plan without priced records: the search's rules on the stage's blocks."""
    replica, stage = plan.stage_of_rank(rank)
    blocks = plan.blocks[stage.first_block: stage.last_block + 1]
    params_fp32 = sum(b.param_bytes for b in blocks)
    weights = params_fp32 * (1.0 + (C.MIXED_PRECISION_WEIGHT_COPY_FACTOR if stage.precision != "fp32" else 0.0))
    gradients = params_fp32
    optimizer = params_fp32 * (C.ADAMW_STATE_FACTOR - 2.0)      # AdamW's two moments
    in_flight = memory.in_flight_micro_batches(replica.schedule, stage.index, len(replica.stages),
                                               len(replica.micro_batch_sizes))
    kept, stage_input, working = memory.stage_activation_figures(plan.blocks, stage.first_block, stage.last_block,
                                                                 stage.precision, plan.inputs.trace_batch)
    activations = memory.kept_activation_bytes(kept, stage_input, working, max(replica.micro_batch_sizes),
                                               in_flight, stage.recompute)
    rest = max(plan.estimates.memory_bytes[rank] - (weights + gradients + optimizer + activations), 0.0)
    compressed = any(rank in g.ranks and g.compressor != "none" for g in plan.grad_groups)
    if not compressed or spec is None or stage.device >= spec.num_devices:
        return weights, gradients, optimizer, activations, 0.0, rest
    framework = min(memory.framework_bytes(spec.devices()[stage.device].type), rest)
    return weights, gradients, optimizer, activations, rest - framework, framework

