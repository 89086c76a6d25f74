"""Real data: the model file's `dataset()` read through a DataLoader, by the ranks that need it only.

A model file may define `dataset()`: a map-style dataset (`__len__`, `__getitem__`) whose sample i is one
row `(inputs..., target)`, each tensor without the batch dimension. Step k's global batch is then the G
samples rows.Selection names: epoch e is `torch.randperm(len)` under a generator seeded from (seed, e),
read in order one global batch after another; the last `len % G` indices of an epoch are dropped (like
`drop_last`), so no step straddles two epochs and every step reads G distinct samples. Replica r takes
its share's slice of those G indices (plan order, rows.rows_of_replica), cut into its micro-batch sizes
(rows.micro_slices); the samples of a micro-batch are stacked like batch()'s rows (default_collate).
Without dataset(), step k's rows are `batch(G, k)`'s, as before.

Only the ranks that need rows read them (`stage_needs`): a stage that reads a model input reads the
inputs, the last stage reads the targets, and every other rank reads nothing (dataset() is not even
called; `meta_inputs` gives it the inputs' shapes). A reading rank builds one `torch.utils.data.DataLoader`
over a batch sampler that yields this replica's micro-batch index lists in step order, so its workers
(forked: the model file is imported under a private module name, so its classes do not pickle) read only
this replica's samples and prefetch across steps; memory is pinned on CUDA.

`global_rows` is the same selection for one process (backends/torchdist/reference.py): all G rows of
step k, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from passes.split import StageSplit
from planner import frontend
from planner.core.ir import Plan
from planner.frontend.model_file import check_dataset_length, dataset_length, load_dataset, stack_samples

from .rows import EVERYTHING, MicroBatch, Needs, Selection, micro_batches, micro_slices

DATA_ENV = "HETPLAN_DATA"  # `--data PATH`: where the model file's dataset() finds its data
DEFAULT_WORKERS = 2        # loader processes per reading rank
DEFAULT_PREFETCH = 2       # micro-batches each worker keeps ready
WORKER_START = "fork"      # the model file's dataset class lives in a module no child could import by name


def stage_needs(split: StageSplit, stage_indices: list[int], is_last: bool) -> Needs:
    """What a rank's stages read of the data: the inputs when one reads a model input, the target when the
    rank runs the last stage."""
    reads_input = any(name in split.model_inputs for k in stage_indices for name in split.stages[k].inputs)
    return Needs(inputs=reads_input, target=is_last)


def global_rows(model_file: frontend.ModelFile, global_batch: int, step: int, seed: int, *,
                dataset: Any = None) -> tuple[tuple[Any, ...], Any]:
    """All rows of step `step` in order, (inputs, target), as the program's replicas read them together:
    the selected samples of dataset() stacked (`dataset`: one already loaded, else dataset() is called),
    or `batch(global_batch, step)`."""
    if model_file.dataset is None:
        return frontend.example_batch_for_step(model_file, global_batch, step)
    data = load_dataset(model_file) if dataset is None else dataset
    length = dataset_length(model_file, data)
    check_dataset_length(model_file, length, global_batch)
    indices = Selection(length, global_batch, seed).global_indices(step)
    return stack_samples([data[i] for i in indices])


def meta_inputs(model_file: frontend.ModelFile, rows: int) -> tuple[Any, ...]:
    """The model's inputs for `rows` rows on the meta device: each tensor input of one row of batch()
    widened to `rows` (planning checked that dataset()'s rows have the same dtypes and shapes), anything
    else as batch() gives it. Reads no data."""
    inputs, _ = frontend.example_batch_for_step(model_file, 1, 0)
    return tuple(torch.empty((rows, *v.shape[1:]), dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor)
                 else v for v in inputs)


class MicroBatchSampler(Sampler[list[int]]):
    """Batch sampler of one replica: its micro-batches' dataset indices, step after step from `first_step`
    (`steps`: how many; None: without end)."""

    def __init__(self, selection: Selection, slices: list[tuple[int, int]], first_step: int = 0,
                 steps: int | None = None) -> None:
        self.selection, self.slices = selection, slices
        self.first_step, self.steps = first_step, steps

    def __iter__(self) -> Iterator[list[int]]:
        step = self.first_step
        while self.steps is None or step < self.steps:
            indices = self.selection.global_indices(step)
            for start, stop in self.slices:
                yield indices[start:stop]
            step += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("a sampler without a step count has no length")
        return max(0, self.steps - self.first_step) * len(self.slices)


def _collate(needs: Needs, samples: list[Any]) -> tuple[tuple[Any, ...], Any]:
    """One micro-batch's samples stacked (in the worker), keeping only what the rank reads."""
    inputs, target = stack_samples(samples)
    return (inputs if needs.inputs else ()), (target if needs.target else None)


def _to_device(value: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples and lists) onto `device`; from pinned memory without blocking."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


class ReplicaData:
    """This rank's micro-batches, step after step: from dataset() through a DataLoader (reading ranks of a
    dataset() file), from batch() (rows.micro_batches), or empty ones (a rank that needs nothing).

    Loading a dataset() checks it before the first step: it is a dataset and holds one global batch
    (ModelFileError otherwise: one line, the run stops). `steps`: the steps the run will take (None: no
    end; workers then read ahead up to `num_workers * prefetch_factor` micro-batches past the last step).
    """

    def __init__(self, model_file: frontend.ModelFile, plan: Plan, replica_index: int, device: torch.device, *,
                 needs: Needs = EVERYTHING, seed: int = 0, steps: int | None = None,
                 num_workers: int = DEFAULT_WORKERS, prefetch_factor: int = DEFAULT_PREFETCH) -> None:
        self.model_file, self.plan, self.replica_index = model_file, plan, replica_index
        self.device, self.needs = device, needs
        self.sizes = plan.replicas[replica_index].micro_batch_sizes
        self._loader: DataLoader[Any] | None = None
        self._batches: Iterator[tuple[tuple[Any, ...], Any]] | None = None
        self._next_step = 0
        if model_file.dataset is None or not needs.anything:
            return
        dataset = load_dataset(model_file)
        length = dataset_length(model_file, dataset)
        check_dataset_length(model_file, length, plan.global_batch)
        self._sampler = MicroBatchSampler(Selection(length, plan.global_batch, seed),
                                          micro_slices(plan, replica_index), 0, steps)
        self._loader = DataLoader(dataset, batch_sampler=self._sampler, collate_fn=partial(_collate, needs),
                                  num_workers=num_workers, persistent_workers=num_workers > 0,
                                  prefetch_factor=prefetch_factor if num_workers > 0 else None,
                                  pin_memory=device.type == "cuda",
                                  multiprocessing_context=WORKER_START if num_workers > 0 else None)

    @property
    def reads_dataset(self) -> bool:
        return self._loader is not None

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """The micro-batches of step `step` on this rank's device (steps in order read ahead; another step
        restarts the loader there)."""
        if self._loader is None:
            if self.model_file.dataset is not None:     # a rank that needs nothing of a dataset() file
                return [MicroBatch((), None, size) for size in self.sizes]
            return micro_batches(self.model_file, self.plan, self.replica_index, step, self.device,
                                 needs=self.needs)
        if self._batches is None or step != self._next_step:
            self._sampler.first_step = step
            self._batches = iter(self._loader)
        out = []
        for size in self.sizes:
            batch = next(self._batches, None)
            if batch is None:
                raise ValueError(f"step {step} is past the {self._sampler.steps} steps this loader reads")
            inputs, target = batch
            out.append(MicroBatch(_to_device(inputs, self.device), _to_device(target, self.device), size))
        self._next_step = step + 1
        return out

    def close(self) -> None:
        """Stop the loader's workers."""
        self._batches = None
        self._loader = None
