"""Compute time of ops and blocks on a device type: roofline with per-op-class efficiency.

With a `Calibration` of the device (`plan profile`), its measured per-op-class rates and per-op
overheads replace the datasheet peak, the efficiency constants and the overhead constants.
"""

from __future__ import annotations

from costmodel import constants as C
from costmodel.calibration import Calibration
from planner.core.blocks import OpCount
from planner.core.cluster import DeviceType


def _is_cpu(device: DeviceType) -> bool:
    return device.vendor.lower() in ("cpu", "generic") or device.name.upper().startswith("CPU") or \
        (device.base or "").upper().startswith("CPU")


def _measured(device: DeviceType, calibration: Calibration | None) -> Calibration | None:
    return calibration if calibration is not None and calibration.matches(device) else None


def op_overhead_s(device: DeviceType) -> float:
    return (C.CPU_OP_OVERHEAD_S if _is_cpu(device) else C.GPU_OP_OVERHEAD_S) * device.slowdown


def _calibrated_op_time_s(op: OpCount, cal: Calibration, precision: str, backward: bool) -> float | None:
    """Measured-rate time of one op, or None when the calibration lacks its class at `precision`."""
    op_class = op.op_class if op.op_class in ("matmul", "conv", "attention") else "elementwise"
    rates = cal.rates(precision, op_class)
    if rates is None:
        return None
    rate = rates.bwd_work_per_s if backward else rates.fwd_work_per_s
    if op_class != "elementwise":
        return (op.bwd_flops if backward else op.fwd_flops) / rate
    return op.fwd_bytes * (C.BACKWARD_BYTES_FACTOR if backward else 1.0) / rate


def op_time_s(op: OpCount, device: DeviceType, precision: str, backward: bool,
              calibration: Calibration | None = None) -> float:
    """Roofline time of one op (no fixed overhead): max(FLOPs / achieved peak, bytes / achieved bw);
    with a calibration of `device`, work / the measured rate of the op's class."""
    if op.op_class == "view":
        return 0.0
    cal = _measured(device, calibration)
    if cal is not None:
        measured = _calibrated_op_time_s(op, cal, precision, backward)
        if measured is not None:
            return measured * device.slowdown
    byte_scale = C.BYTES_PER_ELEMENT[precision] / 4.0
    if backward:
        flops = op.bwd_flops
        nbytes = op.fwd_bytes * C.BACKWARD_BYTES_FACTOR * byte_scale
    else:
        flops = op.fwd_flops
        nbytes = op.fwd_bytes * byte_scale
    dense = op.op_class in ("matmul", "conv", "attention")
    peak = device.peak(precision) * (C.MATMUL_EFFICIENCY if dense else 1.0)
    compute_s = flops / peak if flops else 0.0
    memory_s = nbytes / (device.memory_bandwidth_bytes_s * C.MEMORY_EFFICIENCY)
    return max(compute_s, memory_s) * device.slowdown


def ops_time_s(ops: tuple[OpCount, ...], device: DeviceType, precision: str,
               backward: bool, calibration: Calibration | None = None) -> float:
    return sum(op_time_s(o, device, precision, backward, calibration) for o in ops)


def ops_overhead_s(ops: tuple[OpCount, ...], device: DeviceType, calibration: Calibration | None = None) -> float:
    """Fixed per-micro-batch cost of a run of ops (launches), forward + backward.

    Calibrated: each op's measured forward + backward overhead of its class, views included (on CPU
    a view's dispatch and autograd node cost as much as a small kernel's)."""
    cal = _measured(device, calibration)
    if cal is None:
        executed = sum(1 for o in ops if o.op_class != "view")
        return 2 * executed * op_overhead_s(device)
    total_s = 0.0
    for o in ops:
        op_class = o.op_class if o.op_class in ("matmul", "conv", "attention", "view") else "elementwise"
        rates = cal.overhead_rates(op_class)
        total_s += rates.fwd_overhead_s + rates.bwd_overhead_s if rates else 2 * op_overhead_s(device)
    return total_s * device.slowdown


def optimizer_step_s(param_bytes_fp32: float, tensors: int, device: DeviceType,
                     calibration: Calibration | None = None) -> float:
    """Optimizer step (+ zero_grad) over parameters: streaming traffic; calibrated, a measured fixed
    cost per tensor (the CPU AdamW loop runs per tensor) plus the measured bytes rate.

    A calibrated device's `slowdown` is left out: the emulation pads forward and backward steps only
    (backends/torchdist/runtime.py), so the emulated device runs its optimizer at the host's speed."""
    cal = _measured(device, calibration)
    if cal is None:
        return param_bytes_fp32 * C.OPTIMIZER_BYTES_FACTOR / (device.memory_bandwidth_bytes_s
                                                              * C.MEMORY_EFFICIENCY) * device.slowdown
    return tensors * cal.optimizer_s_per_tensor + param_bytes_fp32 / cal.optimizer_bytes_per_s


def best_precision(device: DeviceType, policy: str) -> str:
    """Training precision for a device under `policy` (fp32 | auto | a precision name)."""
    if policy == "fp32" or _is_cpu(device):
        return "fp32"
    if policy == "auto":
        if device.supports("bf16"):
            return "bf16"
        if device.supports("fp16") and device.tensor_cores:
            return "fp16"
        return "fp32"
    return policy if device.supports(policy) else "fp32"
