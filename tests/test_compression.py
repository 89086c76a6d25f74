"""Gradient compressors on real multi-process gloo groups (torch.multiprocessing, spawn).

Each test launches one group of worker processes running one scenario; the scenario
asserts inside the workers (a failure re-raises here with the worker's traceback).
Inputs are generated from seeds, so every worker can also compute every other
worker's gradient and hence the exact mean and the single-process reference locally.
"""

import os

# Before anything imports triton (here or in the spawned workers, which inherit the
# environment): Triton kernels run in the CPU interpreter. See backends/kernels/_triton.py.
os.environ["TRITON_INTERPRET"] = "1"

import datetime  # noqa: E402
import gc  # noqa: E402
from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from backends.compression import (  # noqa: E402
    COMPRESSORS,
    CollectiveTap,
    FlatBucket,
    OneBitCompressor,
    PowerSGDCompressor,
    make_compressor,
    onebit_wire_bytes,
)
from backends.kernels import (  # noqa: E402
    INTERPRETED,
    Impl,
    add_error_and_sqnorm,
    packed_nbytes,
    sign_pack,
    unpack_average,
)
from tests.helpers import spawn_gloo_workers  # noqa: E402

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_DEADLINE_S = 120.0
FP32_BYTES, HALF_BYTES = 4, 2
FP16_UNIT_ROUNDOFF, BF16_UNIT_ROUNDOFF = 2.0 ** -11, 2.0 ** -8


# ----------------------------------------------------------------------------- process plumbing

def _worker(rank: int, store_port: int, world_size: int, scenario: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        SCENARIOS[scenario](rank, world_size)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def _launch(scenario: str, world_size: int) -> None:
    """Run `scenario` on `world_size` gloo workers; every child is reaped, also on failure."""
    spawn_gloo_workers(_worker, (world_size, scenario), world_size, deadline_s=JOIN_DEADLINE_S)


# ----------------------------------------------------------------------------- inputs

def _all_grads(world_size: int, n: int, step: int, seed: int = 0) -> torch.Tensor:
    """Every rank's gradient for `step`: row r is rank r's [n] float32 gradient."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(world_size, n, generator=gen)


def _gather_equal(t: torch.Tensor) -> bool:
    """Whether every rank holds exactly the same tensor."""
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return all(torch.equal(row, rows[0]) for row in rows)


# ----------------------------------------------------------------------------- scenarios

def _check_onebit_hook_in_ddp(rank: int) -> None:
    """The 1-bit hook plugs into DistributedDataParallel; ranks end with identical gradients."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 3))
    compressor = OneBitCompressor(impl="torch")
    model.register_comm_hook(*compressor.comm_hook())
    torch.manual_seed(1 + rank)
    model(torch.randn(5, 10)).square().sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert _gather_equal(grads)
    assert set(compressor.state.worker_error) == {0}
    # free DDP's reducer (and the gloo work it holds) now, not during interpreter teardown, where a
    # gloo thread releasing tensors aborts the process (cf. pytorch#179291)
    del model
    gc.collect()


def _scenario_hooks(rank: int, world_size: int) -> None:
    """none / fp16 / bf16 against the exact mean; wire bytes per call; the 1-bit hook in DDP."""
    n = 1003
    grads = _all_grads(world_size, n, step=0)
    exact = grads.sum(0) / world_size
    sum_abs = grads.abs().sum(0) / world_size

    none = make_compressor("none")
    result = none.allreduce_mean_(grads[rank].clone())
    torch.testing.assert_close(result, exact, rtol=1e-6, atol=1e-6)
    assert none.last_wire_bytes == n * FP32_BYTES

    for name, unit_roundoff in (("fp16", FP16_UNIT_ROUNDOFF), ("bf16", BF16_UNIT_ROUNDOFF)):
        compressor = make_compressor(name)
        result = compressor.allreduce_mean_(grads[rank].clone())
        # k roundings of the inputs and k - 1 of partial sums, each <= u * sum |x_i| / k.
        assert bool(((result - exact).abs() <= 2 * world_size * unit_roundoff * sum_abs).all()), name
        assert compressor.last_wire_bytes == n * HALF_BYTES == none.last_wire_bytes // 2, name
        assert _gather_equal(result), name

    # bf16 numerics over an fp32 wire (the fallback for backends without bf16).
    fallback = make_compressor("bf16", wire="fp32")
    result = fallback.allreduce_mean_(grads[rank].clone())
    rounded = (grads.to(torch.bfloat16) / world_size).to(torch.float32)
    torch.testing.assert_close(result, rounded.sum(0), rtol=1e-6, atol=1e-7)
    assert fallback.last_wire_bytes == n * FP32_BYTES

    # The counters add up over calls.
    none.allreduce_mean_(grads[rank].clone())
    assert none.calls == 2 and none.total_wire_bytes == 2 * n * FP32_BYTES

    _check_onebit_hook_in_ddp(rank)


def _scenario_powersgd(rank: int, world_size: int) -> None:
    """PowerSGD with rank >= the rank of the averaged gradient reconstructs it (after start_iter)."""
    rows, cols, bias, approx_rank, start_iter = 48, 20, 7, 4, 2
    shapes = [(rows, cols), (bias,)]
    n = rows * cols + bias
    assert world_size <= approx_rank                   # sum of world_size rank-1 matrices
    compressor = PowerSGDCompressor(rank=approx_rank, start_iter=start_iter)
    for step in range(start_iter + 2):
        gen = torch.Generator().manual_seed(step)
        left = torch.randn(world_size, rows, 1, generator=gen)
        right = torch.randn(world_size, 1, cols, generator=gen)
        matrices = left @ right                         # each rank: a rank-1 gradient
        biases = torch.randn(world_size, bias, generator=gen)
        grads = torch.cat([matrices.flatten(1), biases], dim=1)
        result = compressor.allreduce_mean_(FlatBucket(grads[rank].clone(), shapes, index=0))
        torch.testing.assert_close(result, grads.mean(0), rtol=1e-4, atol=1e-5)
        if step < start_iter:
            assert compressor.last_wire_bytes == n * FP32_BYTES
        else:                                           # P [rows, r] + Q [cols, r] + the bias
            assert compressor.last_wire_bytes == ((rows + cols) * approx_rank + bias) * FP32_BYTES
        assert _gather_equal(result)
    assert compressor.state.iter == start_iter + 2


def _simulate_onebit(grads_per_step: list[torch.Tensor], impl: Impl) -> list[torch.Tensor]:
    """Single-process reference of the all-gather 1-bit scheme: all workers, then the server."""
    world_size, n = grads_per_step[0].shape
    worker_err = [torch.zeros(n) for _ in range(world_size)]
    server_err = torch.zeros(n)
    results = []
    for grads in grads_per_step:
        packed, scales = [], []
        for w in range(world_size):
            y, sqnorm = add_error_and_sqnorm(grads[w], worker_err[w], impl=impl)
            scale = torch.sqrt(sqnorm / n).reshape(1)
            bits, worker_err[w] = sign_pack(y, scale, impl=impl)
            packed.append(bits)
            scales.append(scale)
        mean = unpack_average(torch.stack(packed), torch.cat(scales), n, impl=impl)
        z, sqnorm = add_error_and_sqnorm(mean, server_err, impl=impl)
        scale = torch.sqrt(sqnorm / n).reshape(1)
        bits, server_err = sign_pack(z, scale, impl=impl)
        results.append(unpack_average(bits.view(1, -1), scale, n, impl=impl))
    return results


def _scenario_onebit(rank: int, world_size: int) -> None:
    """1-bit == its single-process simulation, bit for bit; error feedback telescopes; bytes."""
    steps, sizes = 3, {0: 1001, 1: 7}                   # two buckets: two sets of error buffers
    impls: list[Impl] = ["torch", "triton"] if INTERPRETED else ["torch"]
    for impl in impls:
        compressor = OneBitCompressor(impl=impl)
        for index, n in sizes.items():
            grads = [_all_grads(world_size, n, step, seed=index) for step in range(steps)]
            expected = _simulate_onebit(grads, impl)
            total = torch.zeros(n)
            for step in range(steps):
                bucket = FlatBucket(grads[step][rank].clone(), index=index)
                with CollectiveTap() as tap:
                    result = compressor.allreduce_mean_(bucket)
                assert torch.equal(result, expected[step]), (impl, index, step)
                assert compressor.last_wire_bytes == tap.total_bytes == packed_nbytes(n) + 4
                assert compressor.last_wire_bytes == onebit_wire_bytes(n)
                total += result
            # Telescoping: sum of results = sum of exact means - mean worker error - server error.
            state = compressor.state
            worker_errors = [torch.empty(n) for _ in range(world_size)]
            dist.all_gather(worker_errors, state.worker_error[index])
            exact_total = sum(g.mean(0) for g in grads)
            recovered = total + torch.stack(worker_errors).mean(0) + state.server_error[index]
            torch.testing.assert_close(recovered, exact_total, rtol=0.0, atol=1e-5)


def _scenario_buckets(rank: int, world_size: int) -> None:
    """`allreduce_mean_buckets_` = one keyed `FlatBucket` per range, written back, times the multiplier."""
    shapes = [(4, 3), (5,), ()]                          # a 0-d tensor travels as [1]
    ranges = [(0, 2), (2, 3)]                            # two buckets: two sets of error buffers
    batched, by_hand = OneBitCompressor(impl="torch"), OneBitCompressor(impl="torch")
    for step in range(2):                                # the second call reuses the error buffers
        gen = torch.Generator().manual_seed(10 * step + rank)
        tensors = [torch.randn(shape, generator=gen) for shape in shapes]
        expected, wire = [], 0
        for index, (start, stop) in enumerate(ranges):
            flat = torch.cat([t.reshape(-1) for t in tensors[start:stop]])
            mean = by_hand.allreduce_mean_(FlatBucket(flat, index=index, is_last=index == 1))
            wire += by_hand.last_wire_bytes
            expected.extend(torch.split(mean * world_size, [t.numel() for t in tensors[start:stop]]))
        assert batched.allreduce_mean_buckets_(tensors, ranges, multiplier=world_size) == wire
        for t, e in zip(tensors, expected):
            assert torch.equal(t, e.view_as(t)), step
    assert set(batched.state.worker_error) == {0, 1}
    assert all(torch.equal(batched.state.worker_error[i], by_hand.state.worker_error[i]) for i in (0, 1))


SCENARIOS: dict[str, Callable[[int, int], None]] = {
    "hooks": _scenario_hooks,
    "powersgd": _scenario_powersgd,
    "onebit": _scenario_onebit,
    "buckets": _scenario_buckets,
}


# ----------------------------------------------------------------------------- tests

def test_fp16_bf16_none_match_exact_mean_and_halve_bytes_and_ddp_hook() -> None:
    _launch("hooks", world_size=2)


def test_powersgd_reconstructs_low_rank_mean_after_start_iter() -> None:
    _launch("powersgd", world_size=4)


def test_onebit_matches_single_process_simulation_and_counts_bytes() -> None:
    _launch("onebit", world_size=3)


def test_buckets_of_tensors_reduce_like_one_flat_bucket_each() -> None:
    _launch("buckets", world_size=2)


def test_registry_names_and_unknown_name() -> None:
    assert set(COMPRESSORS) == {"none", "fp16", "bf16", "powersgd", "onebit"}
    with pytest.raises(ValueError, match="known: bf16, fp16, none, onebit, powersgd"):
        make_compressor("topk")


def test_flat_bucket_views_alias_the_buffer_and_check_shapes() -> None:
    flat = torch.zeros(10)
    bucket = FlatBucket(flat, [(2, 3), (4,)], index=5, is_last=False)
    weight, bias = bucket.gradients()
    weight.fill_(1.0)
    assert flat[:6].eq(1).all() and bias.shape == (4,) and bucket.index() == 5 and not bucket.is_last()
    with pytest.raises(ValueError, match="hold 9 elements"):
        FlatBucket(flat, [(3, 3)])


def test_onebit_wire_bytes_formula() -> None:
    assert [onebit_wire_bytes(n) for n in (0, 1, 8, 9, 1_000_000)] == [0, 5, 5, 6, 125_004]
