"""`plan profile --model`: a model's training step timed in place, on the profiling workers.

The computing workers run the model as a data-parallel job does, all at once: build the batch with
the model file's `batch()`, forward with its loss, backward, synchronise the gradients with the
emitted program's own code (`GradientSync`) over the computing workers, AdamW step and zero_grad.
Each phase is timed inside that loop, so every measurement carries what surrounds it in a real step
(caches left cold by the other phases and processes, a collective entered right after compute) -
which microbenchmarks in a loop miss (see `planner.profiling.microbench`). The micro-batch sizes alternate
over `MODEL_ROUNDS` rounds, so that changes of load hit them alike.

Compute phases (batch, forward, backward, update) are timed in CPU seconds (`microbench.work_clock`;
the host's measured share of a core turns them into wall seconds), the gradient synchronisation and the
whole step in wall seconds.
"""

from __future__ import annotations

from statistics import median
from typing import Any

import torch
import torch.distributed as dist

MODEL_ROUNDS = 3
WARMUP_STEPS = 2
# Besides the small sizes asked for, the model is timed at one large micro-batch: the power of two whose
# forward + backward takes about MODEL_LARGE_STEP_S of CPU (within [MIN, MAX] rows), so that the per-sample
# slope is measured where compute, not dispatch, dominates rather than extrapolated from a few rows.
MODEL_LARGE_STEP_S = 0.05
MIN_LARGE_MICRO_BATCH = 32
MAX_LARGE_MICRO_BATCH = 4096
LARGE_PROBE_RUNS = 3               # timed runs at each small size to choose the large one (fastest kept)


def measure_model(path: str, device: torch.device, repeats: int, micro_batches: tuple[int, ...],
                  group: Any, group_ranks: tuple[int, ...]) -> dict[str, Any]:
    """Per micro-batch size (`micro_batches` and one large size, `large_micro_batch`): median seconds of
    batch(), forward+loss, backward, gradient sync, update, and of the whole step.

    `group` holds the computing workers (`group_ranks`); its all-reduce is the measured sync. The model
    key comes from the planner's own trace on meta (`costmodel.calibration.model_key`)."""
    from backends.torchdist.program.gradsync import GradientSync
    from backends.torchdist.program.optimizers import make_optimizer
    from costmodel.calibration import model_key
    from planner import frontend
    from planner.api import trace_model_file
    from planner.core.ir import GradGroup

    model_file = frontend.load_model_file(path)
    _, blocks, _ = trace_model_file(model_file)
    key = model_key(tuple(b.signature for b in blocks), tuple(b.fwd_flops for b in blocks))
    torch.manual_seed(0)
    module = model_file.build().to(device)
    params = dict(module.named_parameters())
    grad_bytes = float(sum(p.numel() * p.element_size() for p in params.values()))
    for p in params.values():
        p.grad = torch.zeros_like(p)
    sync = GradientSync([GradGroup(0, group_ranks, tuple(params), grad_bytes, "none", "ring", 0.0)],
                        {0: group}, params)
    optimizer = make_optimizer("adamw", list(params.values()), 1e-6)     # the program's AdamW

    def trace(rows: int) -> Any:
        return frontend.trace(module, frontend.to_device(frontend.example_batch(model_file, rows)[0], device),
                              file=path)

    traced = {rows: trace(rows) for rows in micro_batches}
    large = large_micro_batch(model_file, traced, device, group)
    if large not in traced:
        traced[large] = trace(large)
    micro_batches = tuple(traced)
    phases = ("batch_s", "fwd_s", "bwd_s", "sync_s", "update_s", "step_s")
    samples: dict[int, dict[str, list[float]]] = {rows: {k: [] for k in phases} for rows in micro_batches}
    steps = max(repeats // MODEL_ROUNDS, 2)
    for _ in range(MODEL_ROUNDS):
        for rows, gm in traced.items():
            for step in range(WARMUP_STEPS + steps):
                times = _one_step(model_file, gm, rows, step, device, sync, optimizer)
                if step >= WARMUP_STEPS:
                    for name, t in zip(phases, times, strict=True):
                        samples[rows][name].append(t)
    points = [{"micro_batch": float(rows), **{k: median(v) for k, v in by_phase.items()}}
              for rows, by_phase in samples.items()]
    return {"key": key, "path": path, "grad_bytes": grad_bytes, "param_tensors": float(len(params)),
            "processes": float(len(group_ranks)), "points": points}


def large_micro_batch(model_file: Any, traced: dict[int, Any], device: torch.device, group: Any) -> int:
    """The large size to time (see `MODEL_LARGE_STEP_S`): from forward + backward at the two smallest
    traced sizes, the smallest agreed over the group (every worker must run the same sizes in step)."""
    import math

    from planner import frontend
    from planner.profiling.microbench import work_clock

    clock = work_clock(device)
    costs = []
    for rows in sorted(traced)[:2]:
        inputs, target = frontend.to_device(frontend.example_batch(model_file, rows), device)
        times = []
        for _ in range(WARMUP_STEPS + LARGE_PROBE_RUNS):
            start = clock()
            out = traced[rows](*inputs)
            model_file.loss_fn(out[0] if isinstance(out, tuple | list) and len(out) == 1 else out, target).backward()
            _sync_device(device)
            times.append(clock() - start)
        costs.append((rows, min(times[WARMUP_STEPS:])))
    (r0, t0), (r1, t1) = costs
    per_sample_s = max((t1 - t0) / max(r1 - r0, 1), 1e-9)
    rows = 2 ** round(math.log2(max(MODEL_LARGE_STEP_S / per_sample_s, 1.0)))
    agreed = torch.tensor([min(max(rows, MIN_LARGE_MICRO_BATCH), MAX_LARGE_MICRO_BATCH)], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return int(agreed.item())


def _one_step(model_file: Any, gm: Any, rows: int, step: int, device: torch.device, sync: Any,
              optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    """Seconds of each phase of one training step on `rows` samples: batch, forward, backward and update
    on the work clock, gradient sync and the whole step on the wall clock."""
    import time

    from planner import frontend
    from planner.profiling.microbench import work_clock

    clock = work_clock(device)
    step_start = time.perf_counter()
    work = [clock()]
    inputs, target = frontend.to_device(model_file.batch(rows, step), device)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    work.append(clock())
    out = gm(*inputs)
    loss = model_file.loss_fn(out[0] if isinstance(out, tuple | list) and len(out) == 1 else out, target)
    _sync_device(device)
    work.append(clock())
    loss.backward()
    _sync_device(device)
    work.append(clock())
    sync_start = time.perf_counter()
    sync.sync()
    sync_s = time.perf_counter() - sync_start
    work.append(clock())
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    _sync_device(device)
    work.append(clock())
    step_s = time.perf_counter() - step_start
    batch_s, fwd_s, bwd_s, _, update_s = (b - a for a, b in zip(work, work[1:], strict=False))
    return batch_s, fwd_s, bwd_s, sync_s, update_s, step_s


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def computing_group(world: int, concurrency: int) -> tuple[Any, tuple[int, ...]]:
    """The process group of the computing workers (ranks below `concurrency`); every rank must call this."""
    ranks = tuple(range(min(concurrency, world)))
    return dist.new_group(list(ranks)), ranks
