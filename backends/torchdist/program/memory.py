"""A rank's memory: its measured peak, the spec's device memory emulated on CPU, and running out of it.

Measured: on CPU the process's own peak resident set, `VmHWM` in /proc/self/status (`ru_maxrss` would
report the launcher's when that was larger: a child inherits it across exec); on CUDA the caching
allocator's peaks, `max_memory_allocated` (tensors) and `max_memory_reserved` (what it holds from the
driver). The plan's estimate is the whole process's need (costmodel.memory: training state, kept
activations and the framework's share), so it compares with these figures directly.

Emulated: with HETPLAN_EMULATE_MEMORY=1 (`plan run --emulate-memory`) a CPU rank may hold at most its
device's memory from the spec (the plan's `estimates.capacity_bytes` of the rank) as data memory:
RLIMIT_DATA, which bounds the heap and every private writable mapping (what VmData counts, and every
tensor torch allocates on CPU). A rank that outgrows it gets the allocation failure a device would
give, instead of borrowing the host's memory.

Running out: an allocation failure (torch.OutOfMemoryError on CUDA; MemoryError or the CPU allocator's
RuntimeError "can't allocate memory") becomes one line naming the rank, its device and stage, the
plan's estimate, the device's capacity and the peak the rank reached (`out_of_memory`).
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from planner.core.errors import HetplanError, printable
from planner.core.ir import Plan

EMULATE_ENV = "HETPLAN_EMULATE_MEMORY"
PROC_STATUS = Path("/proc/self/status")
KIB_BYTES = 1024
MIB_BYTES = 1 << 20
CPU_ALLOCATOR_FAILURE = "can't allocate memory"        # c10's DefaultCPUAllocator, on a failed allocation
TRIED_TO_ALLOCATE = re.compile(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)")
UNIT_BYTES = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class OutOfDeviceMemory(HetplanError):
    """A rank needed more memory than its device has: the plan's estimate fell short of what it ran."""

    exit_code = 1


def own_peak_resident_bytes(status: Path = PROC_STATUS) -> int:
    """This process's own peak resident set (VmHWM); where /proc is missing, ru_maxrss (which may be the
    launcher's, inherited across exec)."""
    try:
        text = status.read_text()
    except OSError:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KIB_BYTES
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    if found is None:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KIB_BYTES
    return int(found.group(1)) * KIB_BYTES


def peak_memory_fields(device: torch.device) -> dict[str, int | None]:
    """The metrics line's measured memory: `peak_memory_bytes` (CUDA: the allocator's peak of tensors;
    CPU: VmHWM) and `peak_reserved_bytes` (CUDA: the allocator's peak held from the driver; CPU: None)."""
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    return {"peak_memory_bytes": own_peak_resident_bytes(), "peak_reserved_bytes": None}


def measured_peak_bytes(device: torch.device) -> int:
    """The most this rank has held: the allocator's reserved peak on CUDA, VmHWM on CPU."""
    fields = peak_memory_fields(device)
    return int(fields["peak_reserved_bytes"] or fields["peak_memory_bytes"] or 0)


@dataclass
class DataLimit:
    """RLIMIT_DATA as the emulation set it, and the soft limit it replaced (restored by `lift`)."""

    limit_bytes: int
    previous_soft: int
    hard: int

    def lift(self) -> None:
        """Restore the soft limit from before (an unprivileged process may raise it back up to the hard
        limit), so that reporting an allocation failure has memory to do it with."""
        resource.setrlimit(resource.RLIMIT_DATA, (self.previous_soft, self.hard))


def emulation_requested(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this run asked for emulated device memory (HETPLAN_EMULATE_MEMORY=1)."""
    return env.get(EMULATE_ENV, "") == "1"


def limit_data_bytes(limit_bytes: int) -> DataLimit:
    """Let this process hold at most `limit_bytes` of data memory from now on (RLIMIT_DATA's soft
    limit, never above the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = int(limit_bytes) if hard == resource.RLIM_INFINITY else min(int(limit_bytes), hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return DataLimit(limit, soft, hard)


def emulate_device_memory(plan: Plan, rank: int, device: torch.device) -> DataLimit | None:
    """On a CPU rank of a run that asked for it: hold the process to its device's memory from the spec
    (the plan's capacity of `rank`); None where nothing is emulated (CUDA has its own memory)."""
    if device.type != "cpu" or not emulation_requested():
        return None
    return limit_data_bytes(int(plan.estimates.capacity_bytes[rank]))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU
    allocator's RuntimeError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(exc)


def allocation_failure(exc: BaseException) -> BaseException | None:
    """The allocation failure `exc` is or was raised from (a model file's `batch()` failing for want of
    memory is reported as the file's error, from the allocator's), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if is_out_of_memory(current):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def failed_allocation_bytes(exc: BaseException) -> int | None:
    """The size of the allocation that failed, where the allocator's message gives it."""
    found = TRIED_TO_ALLOCATE.search(str(exc))
    return int(float(found.group(1)) * UNIT_BYTES[found.group(2)]) if found else None


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB_BYTES:,.0f} MiB"


def out_of_memory(plan: Plan, rank: int, device: torch.device, exc: BaseException) -> OutOfDeviceMemory:
    """The one-line error of rank `rank` that ran out of memory on `device` while running `plan`."""
    replica, stage = plan.stage_of_rank(rank)
    estimate_bytes = plan.estimates.memory_bytes[rank]
    capacity_bytes = plan.estimates.capacity_bytes[rank]
    tried = failed_allocation_bytes(exc)
    asked = f" allocating {_mib(tried)}" if tried else ""
    return OutOfDeviceMemory(
        f"rank {rank} (replica {replica.index} stage {stage.index} on {printable(stage.device_label)}, "
        f"{printable(stage.device_type)}, {device.type}) ran out of memory{asked} ({type(exc).__name__}): "
        f"the plan estimates {_mib(estimate_bytes)} of the device's {_mib(capacity_bytes)}, the rank had "
        f"reached a peak of {_mib(measured_peak_bytes(device))}",
        file="plan.json", field=f"estimates.memory_bytes[{rank}]",
        fix="re-plan with a larger --memory-margin, a smaller --micro-batch or devices with more memory "
            "(`plan profile` measures this machine's framework memory for the estimate)")
