"""Compute time of ops and blocks on a device type: roofline with per-op-class efficiency."""

from __future__ import annotations

from costmodel import constants as C
from costmodel.ops import OpCount
from planner.spec import DeviceType


def _is_cpu(device: DeviceType) -> bool:
    return device.vendor.lower() in ("cpu", "generic") or device.name.upper().startswith("CPU") or \
        (device.base or "").upper().startswith("CPU")


def op_overhead_s(device: DeviceType) -> float:
    return (C.CPU_OP_OVERHEAD_S if _is_cpu(device) else C.GPU_OP_OVERHEAD_S) * device.slowdown


def op_time_s(op: OpCount, device: DeviceType, precision: str, backward: bool) -> float:
    """Roofline time of one op (no fixed overhead): max(FLOPs / achieved peak, bytes / achieved bw)."""
    if op.op_class == "view":
        return 0.0
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
               backward: bool) -> float:
    return sum(op_time_s(o, device, precision, backward) for o in ops)


def ops_overhead_s(ops: tuple[OpCount, ...], device: DeviceType) -> float:
    """Fixed per-micro-batch cost of a run of ops (launches), forward + backward."""
    executed = sum(1 for o in ops if o.op_class != "view")
    return 2 * executed * op_overhead_s(device)


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
