"""The measurements behind `plan profile`, as run inside one calibration worker process.

Each compute measurement times a chain of `CHAIN_OPS` aten ops of one kind and size (each op's input
is the previous op's output and each has its own weights, as in a traced stage), forward with
autograd recording and backward, and reports seconds per op. Work per op is counted by
`costmodel.ops.OpCounter`, the same counter the planner uses, so the fitted rates apply to its counts.

On a CPU device compute is timed in CPU seconds of the process (`work_clock`), not wall seconds: when
more processes than cores share the host, a short timed region runs either whole inside one time slice
(wall = CPU) or across another process's slice (wall = CPU + that slice), so wall medians of short
regions say little about the share of a core a process really gets. That share is measured once, over
windows much longer than a time slice (`measure_contention`), and converts CPU seconds to wall seconds
(measured here, 4 processes on 2 cores: 1.96-2.04 wall seconds per CPU second).

Every timed repetition follows `DISTURB_S` of unrelated work (a matmul and a sweep over a buffer
larger than the caches): in a training step each op and each collective runs once, between others,
and on an oversubscribed CPU host that makes them markedly slower than in a hot loop (measured here,
4 gloo ranks on 2 cores: an all-reduce of 288 KB took 14 ms after compute against 8 ms back to back;
the mlp example's forward+backward 1.7 ms against 0.9-1.3 ms).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean, median
from typing import Any

import torch
import torch.distributed as dist

from costmodel import constants as C
from costmodel.ops import OpCounter

# Ops per timed chain: enough that one backward call's fixed start-up cost (~20 us on CPU) is
# spread thin, as it is over a stage's many ops.
CHAIN_OPS = 8
WARMUP_RUNS = 2
DISTURB_S = 0.002         # unrelated work before each timed repetition (see the module docstring)
_DISTURB_BUFFER_ELEMENTS = 1 << 20   # 4 MB of fp32: more than a core's L2 cache
aten = torch.ops.aten
_scratch: dict[str, torch.Tensor] = {}


def disturb() -> None:
    """Run `DISTURB_S` of unrelated CPU work (matmuls and a sweep over a cache-sized buffer)."""
    if not _scratch:
        _scratch.update(a=torch.randn(128, 128), buf=torch.randn(_DISTURB_BUFFER_ELEMENTS))
    end = time.perf_counter() + DISTURB_S
    while time.perf_counter() < end:
        _scratch["a"] @ _scratch["a"]
        _scratch["buf"].mul_(1.0)


@dataclass(frozen=True)
class Case:
    """One benchmark point: an op class, a label, the op and its inputs' builder."""

    op_class: str
    label: str
    target: Any                                            # the aten overload, as in a traced graph
    make: Callable[[torch.device, torch.dtype], tuple[torch.Tensor, tuple[Any, ...]]]
    # make -> (chain input, extra args after the chained tensor); op(x, *extra) has x's shape
    kwargs: tuple[tuple[str, Any], ...] = ()


def rand(*shape: int, device: torch.device, dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    """A random op input of `shape` (requiring grad by default), as the benchmark cases build them."""
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


@dataclass(frozen=True)
class Rand:
    """An extra argument of a case that is a random tensor of `shape` (the others are passed as given)."""

    shape: tuple[int, ...]


def make_inputs(x_shape: tuple[int, ...], *extra: Any) -> Callable[[torch.device, torch.dtype],
                                                                tuple[torch.Tensor, tuple[Any, ...]]]:
    """A case's `make`: the chained input of `x_shape`, then `extra` with each `Rand` made a tensor."""

    def make(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[Any, ...]]:
        x = rand(*x_shape, device=device, dtype=dtype)
        return x, tuple(rand(*e.shape, device=device, dtype=dtype) if isinstance(e, Rand) else e for e in extra)

    return make


def compute_cases(quick: bool) -> list[Case]:
    """Sizes spanning dispatch-bound (a few rows) to rate-bound (MFLOPs per op) on a CPU core."""
    rows = (1, 256) if quick else (1, 64, 512)
    cases: list[Case] = []
    for d in ((128, 512) if quick else (64, 256, 512)):
        for n in rows:
            cases.append(Case("matmul", f"linear {n}x{d}", aten.linear.default,
                              make_inputs((n, d), Rand((d, d)), Rand((d,)))))
    for c, hw in (((16, 8), (32, 32)) if quick else ((8, 8), (16, 16), (32, 32), (16, 32))):
        cases.append(Case("conv", f"conv3x3 {c}ch {hw}px", aten.conv2d.default,
                          make_inputs((2, c, hw, hw), Rand((c, c, 3, 3)), None, [1, 1], [1, 1])))
    for b, s in (((1, 32), (8, 128)) if quick else ((1, 32), (4, 64), (8, 128))):
        cases.append(Case("attention", f"sdpa {b}x4x{s}x16", aten.scaled_dot_product_attention.default,
                          make_inputs((b, 4, s, 16), Rand((b, 4, s, 16)), Rand((b, 4, s, 16))), (("is_causal", True),)))
    for n in ((8, 2048) if quick else (4, 256, 4096)):
        cases += [
            Case("elementwise", f"gelu {n}x128", aten.gelu.default, make_inputs((n, 128))),
            Case("elementwise", f"add {n}x128", aten.add.Tensor, make_inputs((n, 128), Rand((n, 128)))),
            Case("elementwise", f"layer_norm {n}x128", aten.layer_norm.default,
                 make_inputs((n, 128), [128], Rand((128,)), Rand((128,)))),
            Case("elementwise", f"group_norm {n // 4}x16x8x8", aten.group_norm.default,
                 make_inputs((max(n // 4, 1), 16, 8, 8), 4, Rand((16,)), Rand((16,)))),
            Case("elementwise", f"relu {n}x128", aten.relu.default, make_inputs((n, 128))),
        ]
    cases.append(Case("view", "transpose", aten.transpose.int, make_inputs((16, 16), 0, 1)))
    cases.append(Case("view", "view", aten.view.default, make_inputs((16, 16), [16, 16])))
    return cases


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def work_clock(device: torch.device) -> Callable[[], float]:
    """The clock compute is timed with: CPU seconds of this process on a CPU device (see the module
    docstring; the profiling workers, like the CPU program, run one compute thread, so CPU seconds are
    that thread's), wall seconds on an accelerator (whose kernels run on the device, not on a CPU core)."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def median_time_s(fn: Callable[[], Any], repeats: int, device: torch.device,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of `fn` on `clock` (wall by default) over `repeats` runs after `WARMUP_RUNS` untimed
    ones, each after `disturb()`."""
    for _ in range(WARMUP_RUNS):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        disturb()
        start = clock()
        fn()
        _sync(device)
        times.append(clock() - start)
    return median(times)


def fwd_bwd_times_s(forward: Callable[[], Any], backward: Callable[[Any], None], repeats: int,
                    device: torch.device) -> tuple[float, float]:
    """Median forward and median backward seconds (`work_clock`), both timed within each run."""
    fwd, bwd = fwd_bwd_samples_s(forward, backward, repeats, device)
    return median(fwd), median(bwd)


def fwd_bwd_samples_s(forward: Callable[[], Any], backward: Callable[[Any], None], repeats: int,
                      device: torch.device) -> tuple[list[float], list[float]]:
    """Forward and backward seconds (`work_clock`) of `repeats` runs (after `WARMUP_RUNS`)."""
    clock = work_clock(device)
    fwd, bwd = [], []
    for i in range(WARMUP_RUNS + repeats):
        disturb()
        start = clock()
        out = forward()
        _sync(device)
        mid = clock()
        backward(out)
        _sync(device)
        if i >= WARMUP_RUNS:
            fwd.append(mid - start)
            bwd.append(clock() - mid)
    return fwd, bwd


def measure_contention(window_s: float) -> float:
    """Wall seconds per CPU second of this process over `window_s` of CPU-bound work (`disturb`'s), run by
    every computing worker at once: the inverse of the share of a core one process of the job gets
    (1.0 with a core per process, about processes / cores when there are fewer)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall0 < window_s:
        disturb()
    return (time.perf_counter() - wall0) / max(time.process_time() - cpu0, 1e-9)


def measure_case(case: Case, device: torch.device, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """Seconds per op, forward and backward, and the planner's work counts of one op."""
    x, extra = case.make(device, dtype)
    extras = [extra] + [case.make(device, dtype)[1] for _ in range(CHAIN_OPS - 1)]   # own weights per op
    kwargs = dict(case.kwargs)
    out = case.target(x, *extra, **kwargs)
    count = OpCounter().count(case.target, (x, *extra), kwargs, out)

    def forward() -> torch.Tensor:
        y = x
        for args in extras:
            y = case.target(y, *args, **kwargs)
        return y

    grad = torch.ones_like(out)
    fwd_s, bwd_s = fwd_bwd_times_s(forward, lambda y: torch.autograd.backward(y, grad), repeats, device)
    return {"op_class": case.op_class, "label": case.label, "fwd_s": fwd_s / CHAIN_OPS, "bwd_s": bwd_s / CHAIN_OPS,
            "fwd_flops": count.fwd_flops, "bwd_flops": count.bwd_flops, "fwd_bytes": count.fwd_bytes,
            "bwd_bytes": count.fwd_bytes * C.BACKWARD_BYTES_FACTOR}


def measure_update(device: torch.device, quick: bool, repeats: int, solo_group: Any) -> list[dict[str, float]]:
    """The program's per-step parameter update, per (tensors, size): on CPU its gradient synchronisation
    code (`backends.torchdist.program.gradsync.GradientSync`: flatten, all-reduce, copy back) over a one-process
    gloo group, so without any transfer; then AdamW step and zero_grad(set_to_none=False). Timed on
    `work_clock`."""
    from backends.torchdist.program.gradsync import GradientSync
    from backends.torchdist.program.optimizers import make_optimizer
    from planner.core.ir import GradGroup

    shapes = ((2, 256), (16, 256), (32, 1024), (4, 65536)) if quick else \
        ((2, 256), (8, 256), (32, 256), (48, 1024), (4, 65536), (16, 16384))
    points = []
    for tensors, numel in shapes:
        params = {f"p{i}": torch.nn.Parameter(torch.randn(numel, device=device)) for i in range(tensors)}
        for p in params.values():
            p.grad = torch.randn_like(p)
        group = GradGroup(0, (dist.get_rank(),), tuple(params), float(tensors * numel * 4), "none", "ring", 0.0)
        sync = GradientSync([group], {0: solo_group}, params) if device.type == "cpu" else None
        opt = make_optimizer("adamw", list(params.values()), 1e-3)     # the program's AdamW

        def step(opt: torch.optim.Optimizer = opt, sync: Any = sync) -> None:
            if sync is not None:      # gloo holds CPU tensors; a GPU program syncs with NCCL instead
                sync.sync()
            opt.step()
            opt.zero_grad(set_to_none=False)

        points.append({"tensors": float(tensors), "param_bytes": float(tensors * numel * 4),
                       "time_s": median_time_s(step, repeats, device, work_clock(device))})
    return points


def _round_trip(buf: torch.Tensor, peer: int, first: bool, message_tag: int = 0) -> None:
    """`buf` to `peer` and back (`first`: this rank sends first), each transfer waited for."""
    for op in ((dist.isend, dist.irecv) if first else (dist.irecv, dist.isend)):
        work = op(buf, peer, tag=message_tag)
        if work is not None:      # None only for a rank outside the group
            work.wait()


# While one pair of workers exchanges messages, the others compute for this long (longer than the pair's
# repetitions take), so that every message is received under the job's real contention.
IN_PLACE_WINDOW_S = 0.5
IN_PLACE_REPEATS_FACTOR = 2


def measure_p2p_in_place(rank: int, world: int, quick: bool, repeats: int) -> list[dict[str, float]]:
    """One-way point-to-point time per message size as a pipeline sees it: pairs (0,1), (2,3), ... take
    turns at ping-pong (one way = half the round trip) while every other worker computes. In a pipeline
    a stage waits for its neighbour while the other ranks of the job compute, so the receiver's wake-up
    competes with them for a core; ping-pong while everyone idles (`measure_comm`) misses that: on a
    virtual host an idle processor wakes up slowly (measured here, 4 processes on 2 cores, up to 64 KB:
    0.3-1.9 ms one way while the others compute, 2.9-3.6 ms while all idle). The figure is the mean over
    `IN_PLACE_REPEATS_FACTOR * repeats` round trips after `WARMUP_RUNS`, not the median: a wake-up now
    and then waits out another process's time slice (a tail of several ms), and a pipeline pays every
    one of them."""
    pairs = [(r, r + 1) for r in range(0, world - 1, 2)]
    points = []
    for nbytes in comm_sizes(quick):
        buf = torch.zeros(max(nbytes // 4, 1))
        per_pair = []
        for a, b in pairs:
            dist.barrier()
            start = time.perf_counter()
            if rank in (a, b):
                peer, first = (b, True) if rank == a else (a, False)
                times = []
                for i in range(WARMUP_RUNS + IN_PLACE_REPEATS_FACTOR * repeats):
                    t0 = time.perf_counter()
                    _round_trip(buf, peer, first, i)
                    times.append((time.perf_counter() - t0) / 2)
                per_pair.append(mean(times[WARMUP_RUNS:]))
            else:
                while time.perf_counter() - start < IN_PLACE_WINDOW_S:
                    disturb()
        dist.barrier()
        if per_pair:
            points.append({"bytes": float(buf.numel() * 4), "time_s": median(per_pair)})
    return points


def comm_sizes(quick: bool) -> tuple[int, ...]:
    """Message sizes in bytes: latency-bound to bandwidth-bound."""
    return (4, 65536, 1 << 20) if quick else (4, 4096, 65536, 1 << 20, 4 << 20)


def measure_comm(rank: int, world: int, quick: bool, repeats: int) -> dict[str, list[dict[str, float]]]:
    """Ping-pong (one way = half the round trip) and all-reduce inside pairs (0,1), (2,3), ... at once,
    then (more than two processes) all-reduce over all of them.

    Every rank creates every pair group (new_group is collective); a rank without a partner idles."""
    pairs = [(r, r + 1) for r in range(0, world - 1, 2)]
    groups = [dist.new_group(list(p)) for p in pairs]
    mine = next((i for i, p in enumerate(pairs) if rank in p), None)
    result: dict[str, list[dict[str, float]]] = {"p2p": [], "allreduce_2": []}
    for nbytes in comm_sizes(quick):
        buf = torch.zeros(max(nbytes // 4, 1))
        dist.barrier()
        if mine is None:
            dist.barrier()
            continue
        peer = pairs[mine][1] if rank == pairs[mine][0] else pairs[mine][0]
        first = rank == pairs[mine][0]

        def ping_pong(buf: torch.Tensor = buf, peer: int = peer, first: bool = first) -> None:
            _round_trip(buf, peer, first)

        def allreduce(buf: torch.Tensor = buf, group: Any = groups[mine]) -> None:
            dist.all_reduce(buf, group=group)

        cpu = torch.device("cpu")
        # after work, as in a pipeline: on an oversubscribed host the partner's wake-up is part of the cost
        result["p2p"].append({"bytes": float(buf.numel() * 4),
                              "time_s": median_time_s(ping_pong, repeats, cpu) / 2})
        result["allreduce_2"].append({"bytes": float(buf.numel() * 4),
                                      "time_s": median_time_s(allreduce, repeats, cpu)})
        dist.barrier()
    if world > 2:     # the whole world at once, as a data-parallel job's gradient all-reduce
        result["allreduce_world"] = []
        for nbytes in comm_sizes(quick):
            buf = torch.zeros(max(nbytes // 4, 1))
            dist.barrier()
            result["allreduce_world"].append({"bytes": float(buf.numel() * 4), "processes": float(world),
                                              "time_s": median_time_s(functools.partial(dist.all_reduce, buf),
                                                                      repeats, torch.device("cpu"))})
    return result
