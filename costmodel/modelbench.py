"""`plan profile --model`: a model's training step timed in place, on the profiling workers.

The computing workers run the model as a data-parallel job does, all at once: build the batch with
the model file's `batch()`, forward with its loss, backward, synchronise the gradients with the
emitted program's own code (`GradientSync`) over the computing workers, AdamW step and zero_grad.
Each phase is timed inside that loop, so every measurement carries what surrounds it in a real step
(caches left cold by the other phases and processes, a collective entered right after compute) -
which microbenchmarks in a loop miss (see `costmodel.microbench`). Two micro-batch sizes alternate
over `MODEL_ROUNDS` rounds, so that changes of load hit both alike.
"""

from __future__ import annotations

from statistics import median
from typing import Any

import torch
import torch.distributed as dist

MODEL_ROUNDS = 3
WARMUP_STEPS = 2


def measure_model(path: str, device: torch.device, repeats: int, micro_batches: tuple[int, ...],
                  group: Any, group_ranks: tuple[int, ...]) -> dict[str, Any]:
    """Per micro-batch size: median seconds of batch(), forward+loss, backward, gradient sync, update.

    `group` holds the computing workers (`group_ranks`); its all-reduce is the measured sync. The model
    key comes from the planner's own trace on meta (`costmodel.calibration.model_key`)."""
    from backends.torchdist.gradsync import GradientSync
    from costmodel.calibration import model_key
    from planner import frontend
    from planner.api import trace_model_file
    from planner.ir import GradGroup

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
    optimizer = torch.optim.AdamW(list(params.values()), lr=1e-6)
    traced = {rows: frontend.trace(module, frontend.to_device(frontend.example_batch(model_file, rows)[0], device),
                                   file=path) for rows in micro_batches}
    phases = ("batch_s", "fwd_s", "bwd_s", "sync_s", "update_s")
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


def _one_step(model_file: Any, gm: Any, rows: int, step: int, device: torch.device, sync: Any,
              optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    """Seconds of each phase of one training step on `rows` samples."""
    import time

    from planner import frontend

    marks = [time.perf_counter()]
    inputs, target = frontend.to_device(model_file.batch(rows, step), device)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    marks.append(time.perf_counter())
    out = gm(*inputs)
    loss = model_file.loss_fn(out[0] if isinstance(out, tuple | list) and len(out) == 1 else out, target)
    _sync_device(device)
    marks.append(time.perf_counter())
    loss.backward()
    _sync_device(device)
    marks.append(time.perf_counter())
    sync.sync()
    marks.append(time.perf_counter())
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    _sync_device(device)
    marks.append(time.perf_counter())
    return tuple(b - a for a, b in zip(marks, marks[1:], strict=False))


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def computing_group(world: int, concurrency: int) -> tuple[Any, tuple[int, ...]]:
    """The process group of the computing workers (ranks below `concurrency`); every rank must call this."""
    ranks = tuple(range(min(concurrency, world)))
    return dist.new_group(list(ranks)), ranks
