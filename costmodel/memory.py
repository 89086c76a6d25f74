"""Memory per device: training state, activations kept per schedule, framework overhead."""

from __future__ import annotations

from costmodel import constants as C
from costmodel.calibration import Calibration
from costmodel.compute import _is_cpu
from planner.core.cluster import DeviceType


def state_bytes(param_bytes_fp32: float, precision: str) -> float:
    """Weights + gradients + AdamW moments (+ low-precision weight copy under mixed precision)."""
    factor = C.ADAMW_STATE_FACTOR
    if precision != "fp32":
        factor += C.MIXED_PRECISION_WEIGHT_COPY_FACTOR
    return param_bytes_fp32 * factor


def activation_bytes(stash_bytes_fp32_per_sample: float, precision: str, micro_batch: int,
                     in_flight: int) -> float:
    return stash_bytes_fp32_per_sample * C.BYTES_PER_ELEMENT[precision] / 4.0 * micro_batch * in_flight


def in_flight_micro_batches(schedule: str, stage: int, num_stages: int, num_micro: int) -> int:
    """Micro-batches whose activations a stage holds at peak: 1F1B keeps S - s, GPipe all M."""
    if schedule == "gpipe":
        return num_micro
    return min(num_stages - stage, num_micro)


def framework_bytes(device: DeviceType, calibration: Calibration | None = None) -> float:
    """Memory a process holds before any model state: measured when `calibration` covers `device`."""
    if calibration is not None and calibration.matches(device):
        return calibration.framework_bytes
    return C.CPU_FRAMEWORK_OVERHEAD_BYTES if _is_cpu(device) else C.GPU_FRAMEWORK_OVERHEAD_BYTES


def usable_bytes(device: DeviceType, margin: float) -> float:
    return device.memory_bytes * (1.0 - margin)
