"""Measure the bytes a rank hands to collectives: `WireRecord`s and a `CollectiveTap`.

"Wire bytes" here means the payload this rank passes *into* a collective: the input
tensor(s) of an all-reduce or all-gather, summed over calls. What a ring or tree
algorithm actually moves per link is a multiple of that (2(k-1)/k for a ring
all-reduce, (k-1)/k x k for an all-gather's output); that factor belongs to the cost model.

`CollectiveTap` observes torch's c10d dispatcher ops (`c10d::allreduce_`, ...) with a
`TorchDispatchMode`. Such a mode is thread-local: it sees collectives issued by the
thread that entered it, but not those issued from a `Future.then` callback, which runs on
the backend's completion thread. Code that chains collectives through callbacks (the
built-in PowerSGD hook) must account for them another way (see `hooks.PowerSGDCompressor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class WireRecord:
    """One collective call: its name, the payload dtype and the payload size in bytes."""

    op: str
    dtype: torch.dtype
    nbytes: int


def payload_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes held by `tensors` (element count x element size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


# c10d op name -> position of the argument that holds this rank's input payload.
_PAYLOAD_ARG: dict[str, int] = {
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "reduce_": 0,
    "send": 0,
    "_allgather_base_": 1,
    "allgather_": 1,
    "allgather_coalesced_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_": 1,
    "alltoall_base_": 1,
    "alltoall_": 1,
    "gather_": 1,
    "scatter_": 1,
}


def _flatten_tensors(arg: Any) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for item in arg for t in _flatten_tensors(item)]
    return []


class CollectiveTap(TorchDispatchMode):
    """Records every c10d collective issued by this thread while the tap is entered.

    >>> with CollectiveTap() as tap:            # doctest: +SKIP
    ...     dist.all_reduce(t)
    >>> tap.total_bytes                         # doctest: +SKIP

    Payload = the input tensors as listed in `_PAYLOAD_ARG` (for a `scatter_` only the
    root's inputs are real data). Ops without an entry (barrier, recv) are recorded with 0 bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[WireRecord] = []

    @property
    def total_bytes(self) -> int:
        """Sum of recorded payload bytes."""
        return sum(r.nbytes for r in self.records)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func.namespace == "c10d":
            op = func._schema.name.split("::", 1)[1]
            position = _PAYLOAD_ARG.get(op)
            tensors = _flatten_tensors(args[position]) if position is not None else []
            dtype = tensors[0].dtype if tensors else torch.uint8
            self.records.append(WireRecord(op, dtype, payload_nbytes(tensors)))
        return func(*args, **(kwargs or {}))
