"""Single-process training with the emitted program's contract: the reference a run is checked against.

Same seed -> same initial weights (the init contract of backends/torchdist/program/materialise.py, for
the whole model); step k trains on the program's rows (`batch(global_batch, k)`, or the dataset()
selection for `seed`: program/data.py); loss = loss_fn (mean over rows); AdamW (or SGD) exactly as the
program builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from backends.torchdist.program import data, materialise, weights
from backends.torchdist.program.optimizers import make_optimizer
from backends.torchdist.program.rows import slice_rows
from planner import frontend
from planner.frontend.model_file import load_dataset


@dataclass
class ReferenceRun:
    losses: list[float]
    params: dict[str, torch.Tensor]


def train_reference(model_path: str, *, global_batch: int, steps: int, seed: int = 0, lr: float = 1e-3,
                    optimizer: str = "adamw", names: dict[str, str] | None = None,
                    accumulate: list[int] | None = None, weights_path: Path | None = None) -> ReferenceRun:
    """Train `steps` steps in this process, on one CPU thread as each rank of the program computes (torch's
    multi-threaded convolution backward sums in another order: 1e-3 apart after ten SGD steps of the
    ResNet example, where one thread is 1e-6 from itself under another micro-batching).

    `accumulate`: row counts that cut each global batch into consecutive micro-batches whose gradients
    add up before the step (gradient accumulation, each loss weighted by rows / global batch): the same
    update in another summation order. A plan's micro-batches in plan order give the program's order, so
    the comparison sees the program's arithmetic rather than float noise AdamW amplifies on near-zero
    gradients (about 1e-5 after ten steps between two orders of one process). `weights_path`: start from
    those weights, as `--weights` does (program/weights.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model_path, global_batch=global_batch, steps=steps, seed=seed, lr=lr, optimizer=optimizer,
                      names=names, accumulate=accumulate, weights_path=weights_path)
    finally:
        torch.set_num_threads(threads)


def _train(model_path: str, *, global_batch: int, steps: int, seed: int, lr: float, optimizer: str,
           names: dict[str, str] | None, accumulate: list[int] | None, weights_path: Path | None) -> ReferenceRun:
    sizes = accumulate or [global_batch]
    if sum(sizes) != global_batch:
        raise ValueError(f"accumulate {sizes} does not add up to the global batch {global_batch}")
    model_file = frontend.load_model_file(model_path, names)
    model = materialise.full_model(model_file, seed)
    if weights_path is not None:
        tensors = dict(model.state_dict(keep_vars=True))
        weights.load_into(weights_path, tensors, weights.tied_aliases(model), model_names=list(tensors))
    dataset = load_dataset(model_file) if model_file.dataset is not None else None
    model.train()
    opt = make_optimizer(optimizer, list(model.parameters()), lr)
    losses = []
    for step in range(steps):
        inputs, target = data.global_rows(model_file, global_batch, step, seed, dataset=dataset)
        total, start = 0.0, 0
        for rows in sizes:
            part = slice_rows(inputs, start, start + rows), slice_rows(target, start, start + rows)
            loss = model_file.loss_fn(model(*part[0]), part[1])
            (loss * (rows / global_batch) if len(sizes) > 1 else loss).backward()
            total += float(loss.detach()) * rows / global_batch
            start += rows
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return ReferenceRun(losses, {n: p.detach().clone() for n, p in model.named_parameters()})
