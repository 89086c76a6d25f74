"""1-bit Adam with AdamW's decoupled weight decay: what a 1-bit gradient group trains with under AdamW.

Sign compression with error feedback is an SGD method (Karimireddy et al., 2019). In front of Adam
it fails: every element of a bucket arrives with the same magnitude, and Adam's per-element
normalisation by sqrt(v) turns the sign noise into full-size updates (measured: +20% final loss
after 200 steps of the bundled GPT, benchmarks/convergence.py before this optimizer). 1-bit Adam
(Tang et al., "1-bit Adam", ICML 2021; DeepSpeed's `OnebitAdam`) avoids it by freezing the
variance after a warm-up and communicating the momentum, which is linear in the gradients, so
error-feedback compression applies to it as it does to SGD's gradient. Per parameter group with a
`MomentumExchange`, at step t (1-based), with m, v the AdamW moments and c the exchange's
`gradient_scale`:

  warm-up      t <= freeze_step   torch AdamW, op for op (`_single_tensor_adam`, the CPU default), on
                                  p.grad, which the caller has already synchronised exactly
  compression  t >  freeze_step   v frozen (its bias correction frozen with it, at t0 = freeze_step)
                                  m_i = b1 m + (1 - b1) c g_i       rank i's local momentum, own gradient
                                  m   = 1-bit mean of m_i            worker + server error feedback
                                  m[v == 0] = 0
                                  p  <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t0)) + eps)

Every rank decodes the same gathered bytes identically (backends.compression.onebit), so m, and
hence the parameters, stay bit-identical across the group. `m[v == 0] = 0` is DeepSpeed's momentum
mask derived from the frozen variance instead of supplied by the user: an element whose gradient was
zero throughout warm-up has no variance estimate, and signs cannot encode zero, so its error-feedback
residue would otherwise be divided by eps. Parameter groups without an exchange are AdamW
throughout. The caller must not also synchronise the gradients of a group in its compression phase
(`exchanging()` names them before each step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from backends.compression.base import GradientCompressor


def freeze_step(total_steps: int, warmup_fraction: float) -> int:
    """Exact AdamW steps before 1-bit Adam freezes the variance, in a run of `total_steps` steps with
    the exact warm-up fraction a plan records for its 1-bit groups (CompressorSettings.warmup_fraction)."""
    if not 0.0 < warmup_fraction <= 1.0:
        raise ValueError(f"1-bit Adam's warm-up fraction must lie in (0, 1], got {warmup_fraction}")
    return max(1, math.ceil(warmup_fraction * total_steps))


@dataclass
class MomentumExchange:
    """How one parameter group's momentum is averaged over its ranks once the variance is frozen.

    `compressor` averages over the group's ranks and owns the error buffers (a 1-bit compressor
    for 1-bit Adam); `buckets` are [start, stop) ranges of the group's parameters, each averaged as
    one flat bucket; every rank's gradient is multiplied by `gradient_scale` before it enters the
    local momentum, so that the group mean of the momenta is built from the gradient the update
    needs (the emitted program sums gradients over a group: its size). `key` is the caller's
    name for the group. Counters describe the last exchange.
    """

    compressor: GradientCompressor
    buckets: Sequence[tuple[int, int]]
    gradient_scale: float = 1.0
    key: int = 0
    wire_bytes: int = 0               # payload handed to collectives
    exchanged_bytes: int = 0          # the momentum, uncompressed

    def exchange_(self, momenta: Sequence[torch.Tensor]) -> None:
        """Replace every rank's local `momenta` by their compressed group mean (collective)."""
        self.wire_bytes = self.compressor.allreduce_mean_buckets_(momenta, self.buckets)
        self.exchanged_bytes = sum(m.numel() * m.element_size() for m in momenta)

    def reset_counters(self) -> None:
        self.wire_bytes = self.exchanged_bytes = 0


class OneBitAdamW(torch.optim.Optimizer):
    """AdamW whose parameter groups with a `MomentumExchange` switch to 1-bit Adam after warm-up.

    `exchanges[i]` belongs to parameter group i (shorter, or None: that group is plain AdamW).
    The exchanges are kept apart from `param_groups` so that `state_dict()` stays plain data.
    `freeze_step`: the exact AdamW steps before the variance freezes (at least 1: a variance of
    zero steps is no estimate). Defaults otherwise are torch.optim.AdamW's.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], *, freeze_step: int,
                 exchanges: Sequence[MomentumExchange | None] = (), lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if freeze_step < 1:
            raise ValueError(f"freeze_step must be at least 1 (exact AdamW steps before the variance "
                             f"freezes), got {freeze_step}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        if len(exchanges) > len(self.param_groups):
            raise ValueError(f"{len(exchanges)} exchanges for {len(self.param_groups)} parameter groups")
        self.freeze_step = freeze_step
        self.exchanges: list[MomentumExchange | None] = [*exchanges,
                                                          *[None] * (len(self.param_groups) - len(exchanges))]

    def steps_taken(self, group: dict[str, Any]) -> int:
        """Steps a parameter group has taken (its first parameter's AdamW step count)."""
        state = self.state.get(group["params"][0]) if group["params"] else None
        return int(state["step"]) if state else 0

    def compressing(self, index: int) -> bool:
        """Whether parameter group `index`'s next step exchanges compressed momentum."""
        return self.exchanges[index] is not None and self.steps_taken(self.param_groups[index]) >= self.freeze_step

    def exchanging(self) -> list[MomentumExchange]:
        """The exchanges the next step runs: their groups' gradients must not be synchronised."""
        return [e for i, e in enumerate(self.exchanges) if e is not None and self.compressing(i)]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            exchange = self.exchanges[index]
            if exchange is not None and self.compressing(index):
                self._compressed_step(group, exchange)
            else:
                self._adamw_step(group, every_param=exchange is not None)
        return loss

    def _state(self, p: nn.Parameter) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _adamw_step(self, group: dict[str, Any], *, every_param: bool) -> None:
        """torch.optim.AdamW's single-tensor step. `every_param`: a missing gradient counts as zero
        (a group that will exchange momentum keeps one step count for all its parameters)."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None and not every_param:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self._state(p)
            state["step"] += 1
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = state["step"].item()
            bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
            denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))

    def _compressed_step(self, group: dict[str, Any], exchange: MomentumExchange) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        states = [self._state(p) for p in group["params"]]
        for p, state in zip(group["params"], states):
            state.setdefault("variance_step", int(state["step"]))   # the step v froze at
            state["step"] += 1
            if p.grad is not None:        # m_i = b1 m + (1 - b1) c g_i (a missing gradient is zero)
                state["exp_avg"].lerp_(p.grad * exchange.gradient_scale, 1 - beta1)
            else:
                state["exp_avg"].mul_(beta1)
        exchange.exchange_([state["exp_avg"] for state in states])
        for p, state in zip(group["params"], states):
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.masked_fill_(exp_avg_sq == 0, 0.0)
            if weight_decay != 0:
                p.mul_(1 - lr * weight_decay)
            step = state["step"].item()
            bias_correction2_sqrt = (1 - beta2 ** state["variance_step"]) ** 0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
