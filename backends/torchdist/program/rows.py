"""The rows of the global batch a replica trains on, cut into its micro-batches.

Step k trains on G = global_batch rows in a fixed order. Replicas take them in plan order by their shares:
replica r takes positions `sum(shares[:r]) .. +shares[r]`, cut into its micro-batch sizes in order
(`micro_slices`), so every rank sees the rows one process would. Where the rows come from:

- a `batch()` model file: the rows of `batch(G, k)` (row i does not depend on G: the model file's
  contract); `micro_batches` cuts them here;
- a `dataset()` model file: the samples `Selection` names. Epoch e is a permutation of the dataset's
  indices (`torch.randperm` with a generator seeded from (seed, e), `epoch_seed`), read in order, one
  global batch after another. An epoch's last `len % G` indices are dropped (like a DataLoader's
  `drop_last`): no step straddles two epochs, every step reads G distinct samples, and an epoch lasts
  `len // G` steps. Step k thus reads positions `(k mod len//G) * G .. +G` of epoch `k div len//G`'s
  permutation. The samples are read by data.py (a DataLoader over this replica's indices), never here.

`Needs` says what a rank reads: the inputs when its stage reads a model input, the target when it computes
the loss; a micro-batch holds `()` for inputs and None for a target it does not need (data.meta_inputs
gives the inputs' shapes without reading them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from planner import frontend
from planner.core.ir import Plan

from .seeds import derived_seed


@dataclass(frozen=True)
class MicroBatch:
    inputs: tuple[Any, ...]    # () where this rank does not read the inputs (Needs.inputs False)
    target: Any                # None where this rank does not read the target
    rows: int


@dataclass(frozen=True)
class Needs:
    """What of each row a rank reads: the inputs (its stage reads a model input), the target (the loss)."""

    inputs: bool = True
    target: bool = True

    @property
    def anything(self) -> bool:
        return self.inputs or self.target


EVERYTHING = Needs()              # inputs and target: a one-stage replica, and the default
NOTHING = Needs(inputs=False, target=False)


def rows_of_replica(plan: Plan, replica_index: int) -> tuple[int, int]:
    """[start, stop) rows of the global batch this replica trains on: shares in plan order."""
    start = sum(r.batch_share for r in plan.replicas[:replica_index])
    return start, start + plan.replicas[replica_index].batch_share


def micro_slices(plan: Plan, replica_index: int) -> list[tuple[int, int]]:
    """[start, stop) positions in the global batch of each of this replica's micro-batches, in order."""
    offset, _ = rows_of_replica(plan, replica_index)
    out = []
    for size in plan.replicas[replica_index].micro_batch_sizes:
        out.append((offset, offset + size))
        offset += size
    return out


def slice_rows(value: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a tensor, or of every tensor in a tuple or list (anything else as it is)."""
    if isinstance(value, torch.Tensor):
        return value[start:stop]
    if isinstance(value, (tuple, list)):
        return type(value)(slice_rows(v, start, stop) for v in value)
    return value


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of epoch `epoch`'s permutation under run seed `seed`: a hash of the pair, so
    neighbouring seeds or epochs give unrelated orders (seed * stride + epoch would collide)."""
    return derived_seed(f"hetplan-data-epoch:{seed}:{epoch}")


class Selection:
    """Which dataset indices step k's global batch reads (the module docstring's rule); it keeps the
    permutation of the epoch last asked for, so stepping through an epoch draws it once."""

    def __init__(self, length: int, global_batch: int, seed: int) -> None:
        if not 0 < global_batch <= length:
            raise ValueError(f"a global batch of {global_batch} needs a dataset of at least as many samples, "
                             f"not {length}")
        self.length, self.global_batch, self.seed = length, global_batch, seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    @property
    def steps_per_epoch(self) -> int:
        return self.length // self.global_batch

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of all indices."""
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._epoch, self._order = epoch, torch.randperm(self.length, generator=generator)
        return self._order

    def global_indices(self, step: int) -> list[int]:
        """The G dataset indices of step `step`'s global batch, in row order."""
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.global_batch
        return self.permutation(epoch)[start:start + self.global_batch].tolist()


def micro_batches(model_file: frontend.ModelFile, plan: Plan, replica_index: int, step: int,
                  device: torch.device, *, needs: Needs = EVERYTHING) -> list[MicroBatch]:
    """The micro-batches of replica `replica_index` at step `step`, on `device`, from the file's batch();
    only what `needs` asks for (nothing needed: batch() is not called). A dataset() file is read by
    data.ReplicaData instead: its rows are not batch()'s."""
    if model_file.dataset is not None:
        raise ValueError(f"{model_file.path} defines dataset(): its rows are read by data.ReplicaData, "
                         f"not cut from batch()")
    sizes = plan.replicas[replica_index].micro_batch_sizes
    if not needs.anything:
        return [MicroBatch((), None, size) for size in sizes]
    inputs, target = frontend.example_batch_for_step(model_file, plan.global_batch, step)
    out = []
    for (start, stop), size in zip(micro_slices(plan, replica_index), sizes, strict=True):
        out.append(MicroBatch(frontend.to_device(slice_rows(inputs, start, stop), device) if needs.inputs else (),
                              frontend.to_device(slice_rows(target, start, stop), device) if needs.target else None,
                              size))
    return out
