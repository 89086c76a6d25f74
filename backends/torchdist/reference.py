"""Single-process training with the emitted program's contract: the reference a run is checked against.

Same seed -> same initial weights, step k on `batch(global_batch, k)`, loss = loss_fn (mean over
rows), AdamW (or SGD) exactly as the program builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.torchdist.program.optimizers import make_optimizer
from planner import frontend


@dataclass
class ReferenceRun:
    losses: list[float]
    params: dict[str, torch.Tensor]


def train_reference(model_path: str, *, global_batch: int, steps: int, seed: int = 0, lr: float = 1e-3,
                    optimizer: str = "adamw", names: dict[str, str] | None = None) -> ReferenceRun:
    model_file = frontend.load_model_file(model_path, names)
    torch.manual_seed(seed)
    model = model_file.build()
    model.train()
    opt = make_optimizer(optimizer, list(model.parameters()), lr)
    losses = []
    for step in range(steps):
        inputs, target = frontend.example_batch_for_step(model_file, global_batch, step)
        loss = model_file.loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return ReferenceRun(losses, {n: p.detach().clone() for n, p in model.named_parameters()})
