"""Per-stage compute precision from the plan: autocast, and plan-wide loss scaling for fp16.

The plan's `StagePlan.precision` (costmodel.compute.best_precision) is applied as

  bf16   torch.autocast(device, bfloat16)                          A100 / H100 / MI250 / ...
  fp16   torch.autocast(device, float16) + dynamic loss scaling    V100 / T4
  fp32   no autocast                                               P100 / CPU

on CUDA ranks. CPU ranks compute in fp32 whatever the plan says, unless the program runs with
`--cpu-autocast` (then bf16/fp16 stages autocast on CPU too: slow, but it exercises the path on a
machine without GPUs). Weights, gradients and optimizer state stay fp32 (autocast keeps fp32
master weights), so gradients are synchronised in fp32.

Loss scaling is plan-wide: stages exchange gradients and all replicas' gradients are summed, so
when any rank computes in fp16 every rank scales its loss by the same factor, the inf/NaN check
is all-reduced over all ranks, and every rank skips the step (and the gradient sync) together.
It is torch's `ShardedGradScaler`, a `torch.amp.GradScaler` whose inf check is all-reduced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from planner.core.ir import Plan, StagePlan

from .placement import uses_cuda

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""Plan precision -> autocast dtype; any other precision (fp32, tf32) runs without autocast."""


def compute_dtype(precision: str, device_type: str, cpu_autocast: bool = False) -> torch.dtype:
    """The dtype a stage of `precision` computes in on a `device_type` ("cuda" | "cpu") rank."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None or (device_type == "cpu" and not cpu_autocast) or device_type not in ("cuda", "cpu"):
        return torch.float32
    return dtype


def stage_compute_dtype(stage: StagePlan, cpu_autocast: bool = False) -> torch.dtype:
    """`compute_dtype` of a plan stage on the device its rank runs on (see placement.uses_cuda)."""
    return compute_dtype(stage.precision, "cuda" if uses_cuda(stage) else "cpu", cpu_autocast)


def needs_loss_scaling(plan: Plan, cpu_autocast: bool = False) -> bool:
    """Whether any rank of the plan computes in fp16 (every rank decides the same)."""
    return any(stage_compute_dtype(s, cpu_autocast) == torch.float16
               for r in plan.replicas for s in r.stages)


@contextlib.contextmanager
def autocast(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Autocast to `dtype` on `device`, or nothing for fp32."""
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


class LossScaler:
    """Plan-wide dynamic loss scaling (torch defaults: 2^16 initial, x2 every 2000 good steps, /2 on
    overflow) over the default process group: every rank must create one and call it in step."""

    def __init__(self, device: torch.device) -> None:
        # imported here, as checkpoints and ZeRO are (checkpoint.py): only an fp16 plan scales its loss
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.scaler = ShardedGradScaler(device=device.type)
        # stages without the loss never call scale(loss); this creates the same scale on every rank
        self.scaler.scale(torch.ones((), device=device))

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (backward from it gives scaled gradients)."""
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide this rank's gradients by the scale; True if any rank found inf/NaN (collective)."""
        self.scaler.unscale_(optimizer)
        found = self.scaler._found_inf_per_device(optimizer)   # all-reduced by unscale_
        return sum(float(v.item()) for v in found.values()) > 0

    def state_dict(self) -> dict[str, float | int]:
        """The scale and its growth state (GradScaler.state_dict: scale, factors, interval, tracker),
        the same on every rank: what a checkpoint keeps so a resumed run scales as it would have."""
        return dict(self.scaler.state_dict())

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Continue with the scale of `state_dict()` (torch writes it into the live scale tensor)."""
        self.scaler.load_state_dict(dict(state))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step unless an inf was found (then skipped on every rank), then update the scale."""
        self.scaler.step(optimizer)
        self.scaler.update()
