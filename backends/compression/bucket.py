"""Run DDP communication hooks on a plain flat gradient bucket, outside DDP.

`torch.distributed.GradBucket` has no Python constructor (torch 2.13: "No constructor
defined"), so hooks written for DDP cannot be handed one. `FlatBucket` is a duck-typed
stand-in providing what the built-in hooks call: `buffer()`, `set_buffer()`, `index()`,
`is_last()`, `gradients()`, `parameters()` (and the older `get_per_parameter_tensors()`).
`run_comm_hook` calls a hook on it, waits, and leaves the result in the bucket's tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

CommHook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
"""A DDP communication hook: (state, bucket) -> Future of the reduced flat tensor."""


class FlatBucket:
    """A `GradBucket`-compatible view of one contiguous 1-D gradient tensor.

    `shapes` gives the per-parameter gradient shapes packed back to back in the tensor;
    `gradients()` returns views of the current buffer with those shapes, so a hook that
    writes into them (PowerSGD does) writes into the buffer. Without shapes the bucket
    is one 1-D gradient. `index` keys per-bucket state (error feedback, PowerSGD's P/Q);
    `is_last` marks the last bucket of an iteration (PowerSGD counts iterations on it).
    """

    def __init__(self, tensor: torch.Tensor, shapes: Sequence[Sequence[int]] | None = None, *,
                 index: int = 0, is_last: bool = True,
                 parameters: Sequence[torch.Tensor] = ()) -> None:
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"a bucket is a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")
        self._shapes = [torch.Size(s) for s in shapes] if shapes is not None else [tensor.shape]
        packed = sum(math.prod(s) for s in self._shapes)
        if packed != tensor.numel():
            raise ValueError(f"shapes hold {packed} elements but the bucket has {tensor.numel()}")
        self._buffer = tensor
        self._index = index
        self._is_last = is_last
        self._parameters = list(parameters)

    def buffer(self) -> torch.Tensor:
        """The flat gradient tensor (as last set)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat tensor (the fp16/bf16 wrappers swap in a cast copy)."""
        if buffer.shape != self._buffer.shape:
            raise ValueError(f"new buffer shape {tuple(buffer.shape)} != {tuple(self._buffer.shape)}")
        self._buffer = buffer

    def index(self) -> int:
        """Bucket index: the key of per-bucket state in hooks."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in an iteration."""
        return self._is_last

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views of the current buffer, shaped as `shapes`."""
        views, offset = [], 0
        for shape in self._shapes:
            numel = math.prod(shape)
            views.append(self._buffer[offset:offset + numel].view(shape))
            offset += numel
        return views

    get_per_parameter_tensors = gradients

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds (may be empty outside DDP)."""
        return list(self._parameters)


def run_comm_hook(hook: CommHook, state: Any, bucket: FlatBucket) -> torch.Tensor:
    """Run `hook(state, bucket)`, wait, and write the result into the bucket's original tensor.

    Returns that tensor (the one the bucket was built on), now holding the reduced values.
    """
    target = bucket.buffer()
    result = hook(state, bucket).wait()
    if isinstance(result, (list, tuple)):  # some hooks' futures carry [tensor]
        result = result[0]
    if result.data_ptr() != target.data_ptr() or result.dtype != target.dtype:
        target.copy_(result)
    return target
