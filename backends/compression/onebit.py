"""1-bit sign compression with error feedback (1-bit Adam's compressed all-reduce), via all-gather.

1-bit Adam (Tang et al., 2021) reduces with an all-to-all: each worker sends chunk j of
its compressed gradient to server j, servers average and re-compress their chunk with a
server error, and an all-gather returns the chunks. This variant needs only an
all-gather, which every backend has (the design notes assume gloo lacks all_to_all;
torch 2.13's gloo does accept `all_to_all_single` on CPU, so an all-to-all variant is
possible later), and every rank plays the server for the whole bucket. For bucket b of
n elements, world size k, on every rank:

  1. worker compression   y = g + e_w[b];  s = ||y||_2 / sqrt(n);
                          packed, e_w[b] = sign_pack(y, s)       (e_w[b] = y - s * sign(y))
  2. all-gather           payload = packed bytes ++ the 4 bytes of float32 s
                          -> [k, ceil(n/8) + 4] uint8 on every rank
  3. decode + average     avg = unpack_average(packed[k], s[k], n)   (same on every rank)
  4. server compression   z = avg + e_s[b];  t = ||z||_2 / sqrt(n);
                          packed', e_s[b] = sign_pack(z, t);  result = t * sign(z)
     (skipped with `server_error_feedback=False`: result = avg)
  5. g <- result

Every rank computes step 3 from the same gathered bytes with the same kernels, so avg,
e_s and the result are identical on all ranks without a second collective. Step 4
spends no bytes here; it keeps 1-bit Adam's two-stage numerics (whose second phase
sends the re-compressed signs), with one server scale per bucket where 1-bit Adam has
one per server chunk. Caveat for mixed hardware: "identical" needs the same `impl` and
the same reduction order on every rank (torch's sum of squares may round differently on
CPU and GPU); ranks that compute step 4 differently drift apart by rounding.

Wire: ceil(n/8) + 4 bytes into the all-gather per rank per call (vs 4n for fp32); each
rank receives k times that, so the all-gather variant pays more than all-to-all's
~2 x (n/8) per rank as k grows. State: e_w and e_s, one fp32 copy each of the bucket.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's
# annotations with the real `dist.GradBucket` / `Future[Tensor]` objects, not strings.
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from backends.compression.base import GradientCompressor, buckets_from_flat, buckets_to_flat
from backends.compression.bucket import CommHook, FlatBucket
from backends.kernels import (
    Impl,
    add_error_and_sqnorm,
    packed_nbytes,
    sign_pack,
    unpack_average,
)

SCALE_NBYTES = 4
"""Bytes of the float32 scale appended to each rank's packed signs."""

_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""One flat all-gather: `all_gather_single` in torch >= 2.13 (the old name is deprecated)."""


@dataclass
class OneBitState:
    """State of 1-bit compression across calls: error buffers per bucket index (float32).

    `impl` picks the kernels (`auto`: Triton on CUDA or under TRITON_INTERPRET=1); every
    rank of a group must use the same one so that all decode identical bytes identically.
    """

    process_group: dist.ProcessGroup | None = None
    server_error_feedback: bool = True
    impl: Impl = "auto"
    worker_error: dict[int, torch.Tensor] = field(default_factory=dict)
    server_error: dict[int, torch.Tensor] = field(default_factory=dict)
    last_wire_bytes: int = 0

    def error_buffer(self, errors: dict[int, torch.Tensor], index: int,
                     like: torch.Tensor) -> torch.Tensor:
        """The error tensor of bucket `index`, zeros on first use (or if the bucket changed size)."""
        err = errors.get(index)
        if err is None or err.shape != like.shape or err.device != like.device:
            err = torch.zeros_like(like, dtype=torch.float32)
            errors[index] = err
        return err


def compress_with_feedback(x: torch.Tensor, err: torch.Tensor, impl: Impl = "auto",
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One error-feedback sign compression: (packed signs, scale [1] float32, new error).

    y = x + err, scale = ||y||_2 / sqrt(n), packed = bits of y >= 0, new error = y - scale*sign(y).
    """
    y, sqnorm = add_error_and_sqnorm(x, err, impl=impl)
    scale = torch.sqrt(sqnorm / x.numel()).to(torch.float32).reshape(1)
    packed, new_err = sign_pack(y, scale, impl=impl)
    return packed, scale, new_err


def onebit_allreduce_mean_(state: OneBitState,
                           bucket: FlatBucket | dist.GradBucket) -> tuple[torch.Tensor, int]:
    """Run the scheme in the module docstring on `bucket` in place.

    Returns (the bucket's tensor, now the decoded mean; payload bytes this rank passed to
    the all-gather). Collective over `state.process_group`.
    """
    buffer = bucket.buffer()
    n = buffer.numel()
    if n == 0:
        return buffer, 0
    group = state.process_group
    world = dist.get_world_size(group)
    x = buffer.to(torch.float32)
    index = bucket.index()

    packed, scale, new_err = compress_with_feedback(
        x, state.error_buffer(state.worker_error, index, x), state.impl)
    state.worker_error[index] = new_err

    nbytes = packed_nbytes(n)
    payload = torch.cat([packed, scale.view(torch.uint8)])
    # gloo's all-gather wants a flat output ([k, m] is rejected: "invalid tensor size").
    gathered = torch.empty(world * payload.numel(), device=x.device, dtype=torch.uint8)
    _all_gather_into(gathered, payload, group=group)
    gathered = gathered.view(world, payload.numel())
    scales = gathered[:, nbytes:].contiguous().view(torch.float32).reshape(world)
    mean = unpack_average(gathered[:, :nbytes].contiguous(), scales, n, impl=state.impl)

    if state.server_error_feedback:
        server_packed, server_scale, server_err = compress_with_feedback(
            mean, state.error_buffer(state.server_error, index, mean), state.impl)
        state.server_error[index] = server_err
        mean = unpack_average(server_packed.view(1, nbytes), server_scale, n, impl=state.impl)

    buffer.copy_(mean)
    state.last_wire_bytes = payload.numel() * payload.element_size()
    return buffer, state.last_wire_bytes


def onebit_hook(state: OneBitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook form: `ddp.register_comm_hook(OneBitState(pg), onebit_hook)`.

    Runs synchronously and returns a completed future. `bucket` may be a `FlatBucket`.
    """
    result, _ = onebit_allreduce_mean_(state, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(result)
    return fut


def onebit_wire_bytes(n: int) -> int:
    """Payload bytes one rank passes to the all-gather for a bucket of n elements."""
    return packed_nbytes(n) + SCALE_NBYTES if n else 0


def onebit_wire_ratio(n: int, element_size: int = 4) -> float:
    """Compressed over uncompressed payload for n elements of `element_size` bytes (~1/32 for fp32)."""
    return onebit_wire_bytes(n) / (n * element_size) if n else math.nan


class OneBitCompressor(GradientCompressor):
    """1-bit sign compression with worker and server error feedback (see module docstring)."""

    name = "onebit"

    def __init__(self, process_group: dist.ProcessGroup | None = None, *,
                 server_error_feedback: bool = True, impl: Impl = "auto") -> None:
        super().__init__(process_group)
        self.state = OneBitState(process_group, server_error_feedback=server_error_feedback, impl=impl)

    def _reduce(self, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
        return onebit_allreduce_mean_(self.state, bucket)

    def comm_hook(self) -> tuple[Any, CommHook]:
        return self.state, onebit_hook

    def state_dict(self) -> dict[str, Any]:
        """The worker and server error buffers per bucket."""
        return {**buckets_to_flat("worker_error", self.state.worker_error),
                **buckets_to_flat("server_error", self.state.server_error)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` of a compressor on the same group and buckets."""
        self.state.worker_error = buckets_from_flat("worker_error", state)
        self.state.server_error = buckets_from_flat("server_error", state)
