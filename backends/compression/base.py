"""The interface every gradient compressor implements."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from backends.compression.bucket import CommHook, FlatBucket


class GradientCompressor(abc.ABC):
    """Averages a flat gradient bucket over a process group (lossy or not) and counts wire bytes.

    Use it either explicitly, on the flat buckets of an emitted program,

        compressor.allreduce_mean_(FlatBucket(flat_grads, shapes, index=i, is_last=...))

    or inside DDP: `ddp.register_comm_hook(*compressor.comm_hook())`.

    After each `allreduce_mean_`, `last_wire_bytes` holds the payload bytes this rank
    passed into collectives during that call (see `wire.py` for what is counted).
    """

    name: ClassVar[str]

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.calls = 0
        self.last_wire_bytes = 0
        self.total_wire_bytes = 0

    def world_size(self) -> int:
        """Ranks in the group the compressor averages over (the default group when None)."""
        return dist.get_world_size(self.process_group)

    def allreduce_mean_(self, grad: torch.Tensor | FlatBucket) -> torch.Tensor:
        """Replace the bucket's values by their (compressed) mean over the group; return them.

        Collective: every rank of the group must call it, with buckets of equal shape, in
        the same order. A bare tensor is treated as one 1-D gradient in bucket 0.
        """
        bucket = grad if isinstance(grad, FlatBucket) else FlatBucket(grad)
        result, wire_bytes = self._reduce(bucket)
        self.calls += 1
        self.last_wire_bytes = wire_bytes
        self.total_wire_bytes += wire_bytes
        return result

    def allreduce_mean_buckets_(self, tensors: Sequence[torch.Tensor], buckets: Sequence[tuple[int, int]], *,
                                multiplier: float = 1.0) -> int:
        """Replace `tensors` by their (compressed) mean over the group times `multiplier`, in place.

        `buckets` are [start, stop) ranges of `tensors`; each range travels as one flat float32
        `FlatBucket` keyed by its position (so per-bucket state persists across calls that pass the
        same ranges). Collective, like `allreduce_mean_`. Returns the payload bytes of all buckets.
        """
        wire = 0
        for index, (start, stop) in enumerate(buckets):
            part = tensors[start:stop]
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t in part])
            # 0-d tensors travel as [1]: PowerSGD views every gradient as [shape[0], -1]
            shapes = [tuple(t.shape) or (1,) for t in part]
            reduced = self.allreduce_mean_(FlatBucket(flat, shapes, index=index, is_last=index == len(buckets) - 1))
            wire += self.last_wire_bytes
            if multiplier != 1.0:
                reduced.mul_(multiplier)
            offset = 0
            for t in part:
                n = t.numel()
                t.copy_(reduced[offset:offset + n].view_as(t))
                offset += n
        return wire

    def state_dict(self) -> dict[str, Any]:
        """The state that carries across calls (error feedback, PowerSGD's P/Q), flat: name -> tensor or
        plain value, for a checkpoint; none here (a compressor without state)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (on the same group and buckets); none here."""
        return None

    @abc.abstractmethod
    def _reduce(self, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
        """Average `bucket` in place; return (its tensor, payload bytes passed to collectives)."""

    @abc.abstractmethod
    def comm_hook(self) -> tuple[Any, CommHook]:
        """(state, hook) for `DistributedDataParallel.register_comm_hook`."""


def buckets_to_flat(prefix: str, per_bucket: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's entries for per-bucket tensors: `<prefix>/<bucket index>` -> tensor."""
    return {f"{prefix}/{index}": tensor for index, tensor in per_bucket.items()}


def buckets_from_flat(prefix: str, state: Mapping[str, Any], device: torch.device | None = None,
                      ) -> dict[int, torch.Tensor]:
    """The per-bucket tensors `buckets_to_flat(prefix, ...)` wrote, on `device` where given."""
    out = {}
    for key, value in state.items():
        head, _, index = key.rpartition("/")
        if head == prefix and index.isdigit():
            out[int(index)] = value if device is None else value.to(device)
    return out
