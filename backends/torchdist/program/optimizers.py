"""The program's optimizers, and one step's gradient sync and update around fp16 loss scaling.

AdamW with torch's defaults but the learning rate, or SGD with momentum 0.9: what the single-process reference
(backends.torchdist.reference) builds. AdamW runs torch's fused kernel where the parameters' device has one
(CPU and CUDA): one pass over each tensor, no temporaries; torch's default on CPU steps tensor by tensor with
two temporaries the size of each (the largest parameter's twice, beside the activations' memory the allocator
keeps from the backward) and took ten times as long on a 131M-parameter stage. Under AdamW the parameters of
`onebit` gradient groups train with 1-bit Adam (backends.compression.onebit_adam) instead, and the parameters
of `zero` groups keep their optimizer state sharded across the group (ZeRO-1, zero.py). A stage without
parameters (the last stage only casts the logits) has no optimizer step: `NoParameters`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from backends.compression import OneBitAdamW, freeze_step
from planner.core.errors import PlanFileError
from planner.core.ir import Plan

from . import precision, zero
from .gradsync import GradientSync

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)   # torch's fused AdamW's


def make_optimizer(name: str, params: list[Any], lr: float, *, fused: bool = True) -> torch.optim.Optimizer:
    """The program's optimizers: AdamW (torch defaults but the learning rate, fused where it can be unless
    `fused` is off: torch's fused AdamW fails under a GradScaler's skipped steps on CPU), or SGD, momentum 0.9."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, fused=fusable(params) if fused else None)


def fusable(params: list[Any]) -> bool | None:
    """True where torch has a fused AdamW for the device and dtype of every parameter (`params`: tensors, or
    parameter groups as ZeroRedundancyOptimizer passes them); else None (torch's choice)."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    devices = torch.utils._foreach_utils._get_fused_kernels_supported_devices()
    fits = all(t.device.type in devices and t.dtype in FUSED_DTYPES for t in tensors)
    return True if tensors and fits else None


class NoParameters(torch.optim.Optimizer):
    """The optimizer of a stage that holds no parameters: its step updates nothing.

    The stage still runs its forward and backward and sends its gradients; it belongs to no gradient
    group (those list parameters), so no gradient sync or 1-bit Adam exchange involves it. Under fp16
    loss scaling it still takes part in the all-ranks inf check (torch's ShardedGradScaler all-reduces
    a flag for a rank without gradients too), so every rank skips a step together. One empty parameter
    group: torch.optim.Optimizer refuses an empty parameter list.
    """

    def __init__(self) -> None:
        super().__init__([{"params": []}], {})

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to update (a closure, as torch's optimizers take one, is not called)."""
        return None


def onebit_freeze_step(plan: Plan, total_steps: int) -> int:
    """1-bit Adam's exact AdamW steps in a run of `total_steps`: the warm-up fraction the plan records
    for its `onebit` groups (1 where the plan has none: no group then freezes anything)."""
    fractions = {g.settings.warmup_fraction for g in plan.grad_groups if g.compressor == "onebit" and g.settings}
    if len(fractions) > 1:
        raise PlanFileError(f"1-bit groups with different warm-up fractions {sorted(fractions)}",
                            field="grad_groups.settings.warmup_fraction", fix="re-plan: one fraction per plan")
    return freeze_step(total_steps, fractions.pop()) if fractions else 1


def make_stage_optimizer(name: str, params: list[nn.Parameter], grad_sync: GradientSync, lr: float, *,
                         onebit_freeze_step: int, loss_scaling: bool = False) -> torch.optim.Optimizer:
    """One rank's optimizer over `params`; call once per GradientSync.

    `make_optimizer(name, params, lr)`, except that under AdamW the parameters of `grad_sync`'s
    `onebit` groups train with 1-bit Adam (OneBitAdamW: exact AdamW for `onebit_freeze_step` steps,
    then frozen variance and 1-bit compressed momentum in place of the group's gradient sync; see
    backends.compression.onebit_adam). 1-bit compression on the gradients themselves only suits SGD.
    The `zero` groups' optimizer state is sharded across their ranks (zero.ShardedStageOptimizer).
    One optimizer for all of the rank's parameters, so that fp16 loss scaling unscales them and skips
    the step together (`loss_scaling`: not the fused AdamW then); `NoParameters` for a stage without any.
    """
    if not params:
        return NoParameters()
    if grad_sync.exchanges:
        raise RuntimeError("make_stage_optimizer: the 1-bit groups' compressors already belong to an optimizer")
    zero.check_groups([g.plan for g in grad_sync.groups], name)
    shards = zero.sharded_groups(grad_sync)
    if shards:
        return zero.ShardedStageOptimizer(params, shards, functools.partial(make_optimizer, name, lr=lr,
                                                                            fused=not loss_scaling))
    if name != "adamw":
        return make_optimizer(name, params, lr)
    handed = grad_sync.momentum_exchanges()     # the exchanges stay listed in grad_sync.exchanges
    if not handed:
        return make_optimizer(name, params, lr, fused=not loss_scaling)
    in_groups = {id(p) for group_params, _ in handed for p in group_params}
    rest = [p for p in params if id(p) not in in_groups]
    groups = [{"params": group_params} for group_params, _ in handed] + ([{"params": rest}] if rest else [])
    return OneBitAdamW(groups, exchanges=[exchange for _, exchange in handed], lr=lr,
                       freeze_step=onebit_freeze_step)


def sync_step_gradients(grad_sync: GradientSync, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None,
                        scaler: precision.LossScaler | None) -> bool:
    """Sum each gradient group's gradients over its ranks (replicas, and stages sharing a weight), with
    the group's compressor; returns whether the step is skipped.

    Groups whose momentum the optimizer exchanges in its coming step (1-bit Adam after warm-up) keep
    their local gradients. Under fp16 loss scaling (`scaler`; needs `optimizer`) gradients are unscaled
    first, and on an overflow anywhere no rank syncs: the step is skipped everywhere (True).
    """
    if grad_sync.exchanges and not isinstance(optimizer, OneBitAdamW):
        raise ValueError("1-bit Adam groups sync through their optimizer (make_stage_optimizer); pass it")
    if scaler is not None:
        if optimizer is None:
            raise ValueError("fp16 loss scaling needs the optimizer to unscale gradients")
        for p in params:                    # every rank takes part in the inf check
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if scaler.unscale_(optimizer):
            return True
    skip = {e.key for e in optimizer.exchanging()} if isinstance(optimizer, OneBitAdamW) else set()
    grad_sync.sync(skip=skip)
    return False


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: precision.LossScaler | None) -> None:
    """The optimizer step (through the loss scaler, which skips it after an overflow)."""
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()
