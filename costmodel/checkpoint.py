"""What a checkpoint costs under a plan, and how often to take one (Young/Daly).

State per rank: its stages' parameters and optimizer state, counted per block as the memory model
counts training state (costmodel.memory.state_bytes: weights, gradient, AdamW's two moments) less what
a checkpoint does not hold: the gradient, and the low-precision copy of mixed precision. AdamW saves
the fp32 weights and two fp32 moments (3x the fp32 parameter bytes), SGD with momentum the weights and
one momentum buffer (2x). Under ZeRO a rank holds, and saves, its share of its gradient groups'
optimizer state.

An asynchronous save (torch.distributed.checkpoint.async_save) costs the step only its staging copy:
each rank copies its state out of device memory (`blocking_s`: bytes / the device's memory bandwidth, a
lower bound where a PCIe link to the host is slower; on a CPU a memcpy reads and writes host memory,
twice the bytes), then writes it to storage in the background (`write_s`: the busiest node's bytes /
its storage write bandwidth). The step waits for the slowest rank's staging.

Young's interval between checkpoints, sqrt(2 x C x MTBF) (Young 1974; Daly 2006 shows it is the
first-order optimum), minimises the time lost to saving plus the work redone after a failure. C is the
time each checkpoint takes from the job: under an asynchronous save that is the blocking copy, not
the background write, which overlaps training. A save cannot start before the previous write ended,
so the interval is at least `write_s`. The job's MTBF is 1 / sum of 1 / MTBF over the plan's devices
(independent failures, any one stops the job); devices without `mtbf_hours` in the spec add nothing
(none known), and with no device giving one the advice has the cost but no interval.
"""

from __future__ import annotations

import math
from dataclasses import replace
from importlib import resources

from costmodel import memory
from costmodel.compute import _is_cpu
from planner.core.cluster import ClusterSpec, Device
from planner.core.fields import Fields, read_yaml
from planner.core.ir import CheckpointAdvice, Plan
from planner.core.units import BYTES_S_PER_GBYTE_S

S_PER_HOUR = 3600.0
GRADIENT_FACTOR = 1.0           # of costmodel.constants.ADAMW_STATE_FACTOR: the gradient, never saved
WEIGHT_FACTOR = 1.0             # of saved_factor: the fp32 weights (the rest is the optimizer's state)
SGD_SAVED_FACTOR = 2.0          # SGD with momentum (the program's): fp32 weights + one momentum buffer
CPU_MEMCPY_PASSES = 2.0         # a host memcpy reads and writes each byte
STORAGE_CATALOG = "storage.yaml"


def saved_factor(optimizer: str) -> float:
    """Checkpoint bytes per fp32 parameter byte: the memory model's training state (fp32, no low-precision
    copy) less the gradient for AdamW; weights and momentum for SGD."""
    if optimizer == "sgd":
        return SGD_SAVED_FACTOR
    return memory.state_bytes(1.0, "fp32") - GRADIENT_FACTOR


def default_storage() -> tuple[float, str]:
    """(bytes/s, source) of the catalog's placeholder storage write bandwidth per node."""
    source = resources.files("costmodel.catalog") / STORAGE_CATALOG
    fields = Fields(str(source), read_yaml(source, str(source)), "", ("default",), ("default",), "storage")
    entry = fields.sub("default", ("write_gbyte_s", "source"), ("write_gbyte_s", "source"), "storage figures")
    return entry.number("write_gbyte_s") * BYTES_S_PER_GBYTE_S, entry.text("source", max_chars=400)


def rank_state_bytes(plan: Plan, optimizer: str) -> list[float]:
    """Checkpoint bytes of each rank: the fp32 parameter bytes of every stage it runs (each parameter once,
    one shard's under tensor parallelism; each chunk's under interleaved 1F1B) x saved_factor, less, in a
    ZeRO gradient group, the optimizer state its other members own (each rank holds and saves 1 / group of
    it)."""
    factor = saved_factor(optimizer)
    out = [0.0] * plan.world_size
    for replica in plan.replicas:
        for st in replica.stages:
            params = st.shard_param_bytes or sum(plan.blocks[b].param_bytes
                                                 for b in range(st.first_block, st.last_block + 1))
            for rank in st.ranks:
                out[rank] += params * factor
    for group in plan.grad_groups:
        if group.zero:
            others = group.nbytes * (factor - WEIGHT_FACTOR) * (1.0 - 1.0 / len(group.ranks))
            for rank in group.ranks:
                out[rank] -= others
    return out


def staging_s(nbytes: float, device: Device) -> float:
    """Seconds to copy `nbytes` of state out of `device`'s memory (a host memcpy on a CPU)."""
    passes = CPU_MEMCPY_PASSES if _is_cpu(device.type) else 1.0
    return nbytes * passes / device.type.memory_bandwidth_bytes_s


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval sqrt(2 x cost x MTBF), both in seconds."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def job_mtbf_s(devices: list[Device]) -> float | None:
    """1 / sum of 1 / MTBF over the devices that give one, in seconds (None: none does)."""
    rates = [1.0 / (d.type.mtbf_hours * S_PER_HOUR) for d in devices if d.type.mtbf_hours]
    return 1.0 / sum(rates) if rates else None


def checkpoint_advice(plan: Plan, spec: ClusterSpec) -> CheckpointAdvice:
    """The checkpoint cost and Young/Daly interval of `plan` on `spec` (the cluster it was planned on)."""
    optimizer = dict(plan.inputs.options).get("optimizer", "adamw")
    all_devices = spec.devices()
    device_of = {rank: all_devices[d] for replica in plan.replicas for st in replica.stages
                 for rank, d, _ in st.rank_devices()}
    devices = [device_of[r] for r in range(plan.world_size)]
    state = rank_state_bytes(plan, optimizer)
    largest = max(range(plan.world_size), key=lambda r: (state[r], -r))
    blocking = max(staging_s(state[r], devices[r]) for r in range(plan.world_size))
    if spec.storage_write_bytes_s is not None:
        storage_bytes_s, source = spec.storage_write_bytes_s, "the spec's storage.write_gbyte_s"
    else:
        storage_bytes_s, source = default_storage()
    per_node: dict[int, float] = {}
    for r, device in enumerate(devices):
        per_node[device.node] = per_node.get(device.node, 0.0) + state[r]
    write = max(per_node.values()) / storage_bytes_s
    mtbf = job_mtbf_s(devices)
    advice = CheckpointAdvice(state_bytes=state[largest], state_rank=largest, blocking_s=blocking, write_s=write,
                              storage_write_bytes_s=storage_bytes_s, storage_source=source,
                              devices_with_mtbf=sum(1 for d in devices if d.type.mtbf_hours))
    if mtbf is None:
        return advice
    interval = max(young_interval_s(blocking, mtbf), write)
    steps = max(1, round(interval / plan.estimates.iteration_s)) if plan.estimates.iteration_s > 0 else 1
    return replace(advice, job_mtbf_s=mtbf, interval_s=interval, interval_steps=steps)
