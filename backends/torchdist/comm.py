"""Process group set-up and the point-to-point / collective helpers the emitted program uses."""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backends.torchdist import activations
from planner.core.ir import Plan, ReplicaPlan, StagePlan

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class Context:
    """Who this process is in the plan."""

    rank: int
    world_size: int
    replica: ReplicaPlan
    stage: StagePlan
    device: torch.device
    grad_groups: dict[int, dist.ProcessGroup | None]   # plan group index -> process group (members only)

    @property
    def num_stages(self) -> int:
        return len(self.replica.stages)

    @property
    def is_first(self) -> bool:
        return self.stage.index == 0

    @property
    def is_last(self) -> bool:
        return self.stage.index == self.num_stages - 1

    def rank_of_stage(self, stage: int) -> int:
        return self.replica.stages[stage].rank


def uses_cuda(stage: StagePlan) -> bool:
    """Whether the rank of `stage` runs on CUDA: a GPU is present and the plan's device is not a CPU."""
    return torch.cuda.is_available() and not stage.device_type.upper().startswith("CPU")


def init(plan: Plan) -> Context:
    """Join the process group (torchrun's environment) and create the gradient groups."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.world_size:
        raise SystemExit(f"plan.json: world_size: the plan needs {plan.world_size} processes, "
                         f"launched with {world} (fix: use launch.sh or `plan run`)")
    rank = int(os.environ.get("RANK", "0"))
    replica, stage = plan.stage_of_rank(rank)
    use_cuda = uses_cuda(stage)
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=float(os.environ.get("HETPLAN_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world, timeout=timeout)
    groups: dict[int, dist.ProcessGroup | None] = {}
    for g in plan.grad_groups:            # every rank creates every group, in plan order
        pg = dist.new_group(list(g.ranks), timeout=timeout)
        if rank in g.ranks:
            groups[g.index] = pg
    return Context(rank, world, replica, stage, device, groups)


def tag(micro: int, value_index: int, backward: bool, num_values: int) -> int:
    """A message tag unique per (micro-batch, value, direction) within one step."""
    return (micro % 2048) * 2 * max(num_values, 1) + 2 * value_index + int(backward)


class P2P:
    """Non-blocking sends (kept alive until `wait_sends`) and blocking receives.

    Each value travels in the wire format of its edge's activation compressor
    (backends.torchdist.activations); `bytes_sent` counts wire bytes.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work | None, torch.Tensor]] = []
        self.bytes_sent = 0
        self.recv_wait_s = 0.0      # time blocked in recv: waiting, not computing

    def send(self, tensor: torch.Tensor, dst: int, message_tag: int, *, dtype: torch.dtype | None = None,
             compressor: str = "none") -> None:
        """Send `tensor` (traced dtype `dtype`, default its own) encoded by `compressor`."""
        buf = activations.encode(compressor, tensor, dtype or tensor.dtype)
        self._pending.append((dist.isend(buf, dst, tag=message_tag), buf))
        self.bytes_sent += buf.numel() * buf.element_size()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, message_tag: int,
             device: torch.device, *, compressor: str = "none") -> torch.Tensor:
        """Receive a value of traced `shape` and `dtype` sent with the same `compressor`."""
        fmt = activations.wire_format(compressor, shape, dtype)
        buf = torch.empty(fmt.shape, dtype=fmt.dtype, device=device)
        start_s = time.perf_counter()
        work = dist.irecv(buf, src, tag=message_tag)
        if work is not None:      # None only for a rank outside the group
            work.wait()
        self.recv_wait_s += time.perf_counter() - start_s
        return activations.decode(compressor, buf, shape, dtype)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            if work is not None:
                work.wait()
        self._pending.clear()


def allreduce_sum_(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> int:
    """Sum `tensors` across the group in one flat buffer; returns the bytes reduced."""
    if not tensors:
        return 0
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
    return flat.numel() * flat.element_size()
