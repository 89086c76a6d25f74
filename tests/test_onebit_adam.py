"""1-bit Adam (backends.compression.onebit_adam) wired as the emitted program wires it.

The multi-process scenario runs on 3 gloo ranks: a `GradientSync` over two plan gradient groups (a
`onebit` one holding w and b, a `none` one holding c), the program's optimizer from
`optimizers.make_stage_optimizer("adamw", ...)`, its gradient sync `optimizers.sync_step_gradients` and fp16
loss scaling. Every rank's gradients come from seeds, so each rank also runs the single-process
reference next to the real thing: torch's AdamW on the synchronised gradient during warm-up, then a
simulation of the compressed momentum exchange (each rank's local momentum, worker and server error
feedback, decoded mean, frozen variance). One rank overflows at one compressed step; every rank skips.
"""

from __future__ import annotations

import datetime
import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from backends.compression import MomentumExchange, OneBitAdamW, make_compressor, onebit_wire_bytes
from backends.kernels import add_error_and_sqnorm, sign_pack, unpack_average
from backends.torchdist.program import optimizers, precision
from backends.torchdist.program.gradsync import GradientSync
from costmodel.compression import settings_of
from planner.core.ir import GradGroup
from tests.helpers import spawn_gloo_workers

WORLD = 3
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_DEADLINE_S = 180.0
SHAPES = {"w": (6, 5), "b": (5,), "c": (4,)}
ONEBIT_PARAMS, EXACT_PARAMS = ("w", "b"), ("c",)
FREEZE_STEP = 2
STEPS = 7
OVERFLOW_STEP = 4             # rank 1 finds an inf here (a compressed step): every rank skips it
LR = 1e-2
BETA1, BETA2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 1e-2   # torch.optim.AdamW's defaults
FP32_BYTES = 4


# ----------------------------------------------------------------------------- inputs

def _initial() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def _local_grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s gradients at `step`. Row 0 of w has no gradient on any rank during warm-up,
    so its frozen variance is zero (the momentum mask's case)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    grads = {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}
    if step < FREEZE_STEP:
        grads["w"][0] = 0.0
    return grads


# ----------------------------------------------------------------------------- reference

def _simulate_onebit_mean(momenta: list[torch.Tensor], worker_err: list[torch.Tensor],
                          server_err: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """All workers' 1-bit compression, the decoded mean, the server's re-compression (one bucket)."""
    n = momenta[0].numel()
    packed, scales, new_worker_err = [], [], []
    for m, err in zip(momenta, worker_err):
        y, sqnorm = add_error_and_sqnorm(m, err)
        scale = torch.sqrt(sqnorm / n).reshape(1)
        bits, new_err = sign_pack(y, scale)
        packed.append(bits)
        scales.append(scale)
        new_worker_err.append(new_err)
    mean = unpack_average(torch.stack(packed), torch.cat(scales), n)
    z, sqnorm = add_error_and_sqnorm(mean, server_err)
    scale = torch.sqrt(sqnorm / n).reshape(1)
    bits, new_server_err = sign_pack(z, scale)
    return unpack_average(bits.view(1, -1), scale, n), new_worker_err, new_server_err


class _Reference:
    """Single-process 1-bit Adam: torch AdamW until the freeze, then the simulated exchange."""

    def __init__(self) -> None:
        self.params = {name: nn.Parameter(t.clone()) for name, t in _initial().items()}
        self.adamw = torch.optim.AdamW(self.params.values(), lr=LR, foreach=False)
        n = sum(math.prod(SHAPES[name]) for name in ONEBIT_PARAMS)
        self.worker_err = [torch.zeros(n) for _ in range(WORLD)]
        self.server_err = torch.zeros(n)
        self.steps = 0

    def exact_step(self, synced: dict[str, torch.Tensor], names: tuple[str, ...]) -> None:
        for name, p in self.params.items():
            p.grad = synced[name].clone() if name in names else None
        self.adamw.step()

    def compressed_step(self, all_local: list[dict[str, torch.Tensor]]) -> None:
        states = [self.adamw.state[self.params[name]] for name in ONEBIT_PARAMS]
        step = float(states[0]["step"]) + 1
        momenta = [torch.cat([state["exp_avg"].lerp(local[name] * WORLD, 1 - BETA1).reshape(-1)
                              for name, state in zip(ONEBIT_PARAMS, states)]) for local in all_local]
        mean, self.worker_err, self.server_err = _simulate_onebit_mean(momenta, self.worker_err, self.server_err)
        offset = 0
        for name, state in zip(ONEBIT_PARAMS, states):
            p, v = self.params[name], state["exp_avg_sq"]
            m = mean[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            m = torch.where(v == 0, 0.0, m)
            state["exp_avg"].copy_(m)
            state["step"].fill_(step)
            with torch.no_grad():
                p.mul_(1 - LR * WEIGHT_DECAY)
                denom = (v.sqrt() / (1 - BETA2 ** FREEZE_STEP) ** 0.5).add_(EPS)
                p.addcdiv_(m, denom, value=-LR / (1 - BETA1 ** step))


# ----------------------------------------------------------------------------- scenario

def _gather_equal(t: torch.Tensor) -> bool:
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t.contiguous())
    return all(torch.equal(row, rows[0]) for row in rows)


def _scenario(rank: int) -> None:
    params = {name: nn.Parameter(t.clone()) for name, t in _initial().items()}
    groups = [GradGroup(0, tuple(range(WORLD)), ONEBIT_PARAMS, 0.0, "onebit", "allgather", 0.0,
                        settings_of("onebit")),
              GradGroup(1, tuple(range(WORLD)), EXACT_PARAMS, 0.0, "none", "ring", 0.0)]
    process_groups = {g.index: dist.new_group(list(g.ranks)) for g in groups}
    sync = GradientSync(groups, process_groups, params)
    optimizer = optimizers.make_stage_optimizer("adamw", list(params.values()), sync, LR,
                                             onebit_freeze_step=FREEZE_STEP)
    assert isinstance(optimizer, OneBitAdamW) and [e.key for e in sync.exchanges] == [0]
    exchange = sync.exchanges[0]
    assert exchange.gradient_scale == WORLD
    scaler = precision.LossScaler(torch.device("cpu"))
    reference = _Reference()
    frozen_variance: dict[str, torch.Tensor] = {}
    onebit_numel = sum(params[name].numel() for name in ONEBIT_PARAMS)
    taken = 0                                            # optimizer steps not skipped
    for step in range(STEPS):
        all_local = [_local_grads(step, r) for r in range(WORLD)]
        local = {name: g.clone() for name, g in all_local[rank].items()}
        if step == OVERFLOW_STEP and rank == 1:
            local["b"][0] = float("inf")
        for name, p in params.items():                   # backward from a scaled loss
            p.grad = local[name] * scaler.scale
        before = {name: p.detach().clone() for name, p in params.items()}
        compressing = taken >= FREEZE_STEP
        assert optimizer.exchanging() == ([exchange] if compressing else [])
        exchange.reset_counters()

        skipped = optimizers.sync_step_gradients(sync, list(params.values()), optimizer, scaler)
        assert skipped == (step == OVERFLOW_STEP)
        if not skipped:
            for name, p in params.items():
                exact_sum = sum(g[name] for g in all_local)
                if compressing and name in ONEBIT_PARAMS:   # left local: momentum goes instead
                    assert torch.equal(p.grad, all_local[rank][name]), (step, name)
                else:                                     # unscaled, then summed exactly
                    torch.testing.assert_close(p.grad, exact_sum, rtol=1e-6, atol=1e-6)
            assert sync.wire_bytes_by_group[0] == (0 if compressing else onebit_numel * FP32_BYTES)
        synced = {name: p.grad.clone() for name, p in params.items()}
        scaler.step(optimizer)
        optimizer.zero_grad()

        if skipped:                                      # nothing moved, on any rank
            assert all(torch.equal(p, before[name]) for name, p in params.items())
            assert exchange.wire_bytes == 0 and scaler.scale == 2.0 ** 15
            continue
        taken += 1
        if compressing:
            reference.compressed_step(all_local)
            reference.exact_step(synced, EXACT_PARAMS)
            assert exchange.wire_bytes == onebit_wire_bytes(onebit_numel)
        else:
            reference.exact_step(synced, tuple(SHAPES))
            assert exchange.wire_bytes == 0
        if taken == FREEZE_STEP:
            frozen_variance = {name: optimizer.state[params[name]]["exp_avg_sq"].clone() for name in ONEBIT_PARAMS}
        for name, p in params.items():
            mine, ref = optimizer.state[p], reference.adamw.state[reference.params[name]]
            assert torch.equal(p.detach(), reference.params[name].detach()), (step, name)
            assert torch.equal(mine["exp_avg"], ref["exp_avg"]), (step, name)
            assert _gather_equal(p.detach()) and _gather_equal(mine["exp_avg"]), (step, name)
            if compressing and name in ONEBIT_PARAMS:
                assert torch.equal(mine["exp_avg_sq"], frozen_variance[name]), (step, name)
    assert taken == STEPS - 1 and taken > FREEZE_STEP
    w = params["w"].detach()
    assert torch.equal(optimizer.state[params["w"]]["exp_avg"][0], torch.zeros(5))   # masked row ...
    decay = (1 - LR * WEIGHT_DECAY) ** taken                                          # ... only decays
    torch.testing.assert_close(w[0], _initial()["w"][0] * decay, rtol=1e-6, atol=0.0)


def _worker(rank: int, store_port: int, world_size: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        _scenario(rank)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_warm_up_is_adamw_then_compressed_momentum_matches_simulation_on_every_rank() -> None:
    spawn_gloo_workers(_worker, (WORLD,), WORLD, deadline_s=JOIN_DEADLINE_S)


# ----------------------------------------------------------------------------- single process

def test_without_exchanges_it_is_torch_adamw_bit_for_bit() -> None:
    torch.manual_seed(0)
    mine = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))]
    theirs = [nn.Parameter(p.detach().clone()) for p in mine]
    optimizer = OneBitAdamW([{"params": mine[:2]}, {"params": mine[2:], "weight_decay": 0.0}],
                            lr=3e-3, freeze_step=1)
    adamw = torch.optim.AdamW([{"params": theirs[:2]}, {"params": theirs[2:], "weight_decay": 0.0}],
                              lr=3e-3, foreach=False)
    for step in range(5):
        for a, b in zip(mine, theirs):
            grad = torch.randn_like(a) if step != 2 or a.dim() == 2 else None   # no gradient: skipped
            a.grad = grad
            b.grad = None if grad is None else grad.clone()
        optimizer.step()
        adamw.step()
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b), step
            assert torch.equal(optimizer.state[a]["exp_avg_sq"], adamw.state[b]["exp_avg_sq"]), step
    assert optimizer.exchanging() == []


def test_bad_arguments_are_refused() -> None:
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="freeze_step must be at least 1"):
        OneBitAdamW([p], freeze_step=0)
    exchange = MomentumExchange(make_compressor("none"), [(0, 1)])
    with pytest.raises(ValueError, match="2 exchanges for 1 parameter groups"):
        OneBitAdamW([p], freeze_step=1, exchanges=[exchange, exchange])
