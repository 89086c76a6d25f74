"""Memory per device: training state, activations kept per schedule, framework overhead, and the one
rule that says whether a stage fits.

The rule (`fits`) is the same everywhere a plan's memory is judged: the stage split's dynamic
programme and greedy test, the GPipe micro-batch limit and the compressor choice in the search, the
per-rank estimate assembly records, and `passes.verify.verify_plan`:

    need     = training state + kept activations + framework + compressor state   (`need_bytes`;
               framework: the process's own memory and the largest gradient's transient, per process)
    capacity = device memory x (1 - margin)                                     (`capacity_bytes`)
    fits    <=> need <= capacity
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, overload

import numpy as np

from costmodel import constants as C
from costmodel.calibration import Calibration
from costmodel.compute import _is_cpu
from planner.core.cluster import DeviceType

Bytes = TypeVar("Bytes", float, np.ndarray)


def state_bytes(param_bytes_fp32: float, precision: str) -> float:
    """Weights + gradients + AdamW moments (+ low-precision weight copy under mixed precision)."""
    factor = C.ADAMW_STATE_FACTOR
    if precision != "fp32":
        factor += C.MIXED_PRECISION_WEIGHT_COPY_FACTOR
    return param_bytes_fp32 * factor


def activation_bytes(stash_bytes_fp32_per_sample: float, precision: str, micro_batch: int,
                     in_flight: int) -> float:
    return stash_bytes_fp32_per_sample * C.BYTES_PER_ELEMENT[precision] / 4.0 * micro_batch * in_flight


# What a backward holds at once beyond the activations kept for it: the gradient of an op's output and of its
# input, twice the stage's largest op output per micro-batch (measured by benchmarks/activation_memory.py on
# the tuned gpt and hf_llama; the other models held out).
BACKWARD_TRANSIENT_OUTPUTS = 2.0


def backward_transient_bytes(largest_output_bytes: float) -> float:
    """The backward's working set for a stage whose largest op output is `largest_output_bytes`."""
    return BACKWARD_TRANSIENT_OUTPUTS * largest_output_bytes


def kept_activation_bytes(kept_bytes: float, stage_input_bytes: float, transient_bytes: float, micro_batch: int,
                          in_flight: int, recompute: bool) -> float:
    """Activations a stage holds at its peak, from its per-sample figures: what its blocks keep for the
    backward (`kept_bytes`) for every micro-batch in flight, or, recomputing, each one's stage input
    (`stage_input_bytes`) and one micro-batch's kept activations while it is recomputed; and the backward's
    working set (`transient_bytes`) for one micro-batch."""
    if not recompute:
        return (kept_bytes * in_flight + transient_bytes) * micro_batch
    return (stage_input_bytes * in_flight + kept_bytes + transient_bytes) * micro_batch


def in_flight_micro_batches(schedule: str, stage: int, num_stages: int, num_micro: int) -> int:
    """Micro-batches whose activations a stage holds at peak: 1F1B keeps S - s, GPipe all M, ZB-H1 up
    to S on every stage (its weight gradients run late: planner.core.schedule.zero_bubble_h1)."""
    if schedule == "gpipe":
        return num_micro
    if schedule == "zbh1":
        return min(num_stages, num_micro)
    return min(num_stages - stage, num_micro)


def framework_bytes(device: DeviceType, calibration: Calibration | None = None) -> float:
    """Memory a process holds before any model state: measured when `calibration` covers `device` (on
    CPU with what the training steps add beyond the profile's measurement, C.CPU_PROGRAM_STEP_BYTES)."""
    if calibration is not None and calibration.matches(device):
        return calibration.framework_bytes + (C.CPU_PROGRAM_STEP_BYTES if calibration.kind == "cpu" else 0.0)
    return C.CPU_FRAMEWORK_OVERHEAD_BYTES if _is_cpu(device) else C.GPU_FRAMEWORK_OVERHEAD_BYTES


LOSS_OUTPUT_COPIES = 3.0   # cross-entropy: its log-softmax kept for the backward, and the backward's two gradients


def loss_bytes(output_bytes: float) -> float:
    """What the loss holds at its backward on the last stage, per sample, for a model output of
    `output_bytes` per sample: a log-softmax of the output kept, then the gradients of it and of the output
    (a language model's logits: vocabulary x sequence per row, the largest activation of its last stage)."""
    return LOSS_OUTPUT_COPIES * output_bytes


def gradient_transient_bytes(largest_param_bytes_fp32: float) -> float:
    """What a backward holds beyond the training state at its peak, besides activations: autograd makes
    each parameter's new gradient whole and then adds it to the one the rank holds (every micro-batch
    after the first, every step after the first), so the largest tensor's gradient is briefly there
    twice. The model's largest parameter tensor bounds it on every stage (an embedding or an LM head:
    a few percent of a stage's state); measured on a 374M-parameter Llama's head, benchmarks/memory_scale.py."""
    return largest_param_bytes_fp32


class BlockFigures(Protocol):
    """A plan's record of a block (planner.core.ir.BlockInfo): its bytes at the trace batch, in fp32."""

    @property
    def activation_bytes(self) -> float: ...
    @property
    def boundary_bytes(self) -> float: ...
    @property
    def transient_bytes(self) -> float: ...
    @property
    def output_bytes(self) -> float: ...


def stage_activation_figures(blocks: Sequence[BlockFigures], first: int, last: int, precision: str,
                             trace_batch: int) -> tuple[float, float, float]:
    """(kept, stage input, working set) per sample of a plan's stage of blocks first..last, at its precision,
    as the cost tables count them (costmodel.tables): the loss's memory on the stage holding the last block,
    the largest boundary of the model as what recomputing keeps of each micro-batch."""
    scale = C.BYTES_PER_ELEMENT[precision] / 4.0 / trace_batch
    own = blocks[first:last + 1]
    kept = sum(b.activation_bytes for b in own)
    if last == len(blocks) - 1:
        kept += loss_bytes(blocks[-1].output_bytes)
    stage_input = max(b.boundary_bytes for b in blocks)
    return kept * scale, stage_input * scale, max((b.transient_bytes for b in own), default=0.0) * scale


def capacity_bytes(memory_bytes: float, margin: float) -> float:
    """What a stage may need on a device of `memory_bytes`: all of it but the margin (fragmentation)."""
    return memory_bytes * (1.0 - margin)


def usable_bytes(device: DeviceType, margin: float) -> float:
    """`capacity_bytes` of a device type."""
    return capacity_bytes(device.memory_bytes, margin)


def need_bytes(state: Bytes, activations: Bytes, framework: float, compressor_state: float = 0.0) -> Bytes:
    """A stage's peak memory: its training state, the activations it keeps, the framework's own memory
    and its gradient compressors' state (error feedback, PowerSGD's P/Q); elementwise on arrays."""
    return state + activations + framework + compressor_state


@overload
def fits(need: float, capacity: float) -> bool: ...
@overload
def fits(need: np.ndarray, capacity: float) -> np.ndarray: ...
def fits(need: float | np.ndarray, capacity: float) -> bool | np.ndarray:
    """The memory rule: a stage that needs `need` bytes fits a device offering `capacity` (elementwise
    on arrays: numpy booleans)."""
    return need <= capacity
