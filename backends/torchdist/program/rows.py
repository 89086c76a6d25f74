"""The rows of the global batch a replica trains on, cut into its micro-batches.

Step k trains on `batch(global_batch, k)` split across replicas in plan order by their shares: replica r
takes rows `sum(shares[:r]) .. +shares[r]`, cut into its micro-batch sizes in order. Row i of the batch
does not depend on the batch size (the model file's contract), so every rank sees the rows one process
would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from planner import frontend
from planner.core.ir import Plan


@dataclass(frozen=True)
class MicroBatch:
    inputs: tuple[Any, ...]
    target: Any
    rows: int


def rows_of_replica(plan: Plan, replica_index: int) -> tuple[int, int]:
    """[start, stop) rows of the global batch this replica trains on: shares in plan order."""
    start = sum(r.batch_share for r in plan.replicas[:replica_index])
    return start, start + plan.replicas[replica_index].batch_share


def slice_rows(value: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a tensor, or of every tensor in a tuple or list (anything else as it is)."""
    if isinstance(value, torch.Tensor):
        return value[start:stop]
    if isinstance(value, (tuple, list)):
        return type(value)(slice_rows(v, start, stop) for v in value)
    return value


def micro_batches(model_file: frontend.ModelFile, plan: Plan, replica_index: int, step: int,
                  device: torch.device) -> list[MicroBatch]:
    """The micro-batches of replica `replica_index` at step `step`, on `device`."""
    inputs, target = frontend.example_batch_for_step(model_file, plan.global_batch, step)
    offset, _ = rows_of_replica(plan, replica_index)
    out = []
    for size in plan.replicas[replica_index].micro_batch_sizes:
        out.append(MicroBatch(frontend.to_device(slice_rows(inputs, offset, offset + size), device),
                              frontend.to_device(slice_rows(target, offset, offset + size), device), size))
        offset += size
    return out
