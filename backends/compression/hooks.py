"""Compressors that reuse torch's built-in DDP communication hooks through `FlatBucket`.

  none      `default_hooks.allreduce_hook`        fp32 (bucket dtype) all-reduce
  fp16      `default_hooks.fp16_compress_hook`    cast to fp16, all-reduce, cast back
  bf16      `default_hooks.bf16_compress_hook`    cast to bf16, all-reduce, cast back
  powersgd  `powerSGD_hook.powerSGD_hook`         rank-r P/Q all-reduces, error feedback,
                                                  warm start, vanilla until start iteration

Wire bytes: the built-in none/fp16/bf16 hooks issue their single all-reduce from the
calling thread, so a `CollectiveTap` measures it. PowerSGD issues its P and Q
all-reduces from future callbacks (another thread, invisible to the tap); its bytes are
taken from `PowerSGDState`'s own element counters, which advance by exactly the element
counts it all-reduces (uncompressed tensors + P + Q), times the bucket's element size.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's
# annotations with the real `dist.GradBucket` / `Future[Tensor]` objects, not strings.
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from backends.compression.base import GradientCompressor, buckets_from_flat, buckets_to_flat
from backends.compression.bucket import CommHook, FlatBucket, run_comm_hook
from backends.compression.wire import CollectiveTap


def _run_tapped(hook: CommHook, state: Any, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
    """Run a hook whose collectives are all issued from this thread; measure their payload."""
    with CollectiveTap() as tap:
        result = run_comm_hook(hook, state, bucket)
    if not tap.records:
        raise RuntimeError(f"{getattr(hook, '__name__', hook)} issued no collective from the calling "
                           "thread; its wire bytes cannot be measured by a CollectiveTap")
    return result, tap.total_bytes


class NoCompression(GradientCompressor):
    """Exact mean: torch's `allreduce_hook` (divide by world size, sum all-reduce)."""

    name = "none"

    def _reduce(self, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
        return _run_tapped(default_hooks.allreduce_hook, self.process_group, bucket)

    def comm_hook(self) -> tuple[Any, CommHook]:
        return self.process_group, default_hooks.allreduce_hook


class Fp16Compressor(GradientCompressor):
    """torch's `fp16_compress_hook`: values (already divided by world size) travel as fp16.

    Half the bytes of fp32; the sum is accumulated in fp16 by the backend, so the mean
    carries fp16 rounding (and overflows past 65504 x world size).
    """

    name = "fp16"

    def _reduce(self, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
        return _run_tapped(default_hooks.fp16_compress_hook, self.process_group, bucket)

    def comm_hook(self) -> tuple[Any, CommHook]:
        return self.process_group, default_hooks.fp16_compress_hook


Bf16Wire = Literal["auto", "bf16", "fp32"]


def bf16_round_fp32_wire_hook(process_group: dist.ProcessGroup | None,
                              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16 compression *numerics* with an fp32 all-reduce, for backends that reject bf16.

    Each rank rounds its (divided) values to bf16 exactly as `bf16_compress_hook` does, then
    all-reduces them as fp32: the sum is exact-er than a bf16 sum and, honestly, the wire
    carries 4 bytes per element: there is no traffic saving on this path.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    rounded = buffer.to(torch.bfloat16).div_(dist.get_world_size(group)).to(torch.float32)
    fut = dist.all_reduce(rounded, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return fut.then(decompress)


class Bf16Compressor(GradientCompressor):
    """torch's `bf16_compress_hook` (values travel as bf16), with an fp32-wire fallback.

    `wire`: `bf16` always uses the built-in hook; `fp32` always uses
    `bf16_round_fp32_wire_hook`; `auto` uses the fallback only for CUDA tensors on a gloo
    group (gloo's CUDA path has no bf16: pytorch/pytorch#111131). CPU tensors on gloo
    all-reduce bf16 fine in torch 2.13 (tested in tests/test_compression.py), so on CPU
    the saving is real.
    """

    name = "bf16"

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, wire: Bf16Wire = "auto") -> None:
        super().__init__(process_group)
        if wire not in ("auto", "bf16", "fp32"):
            raise ValueError(f"wire must be 'auto', 'bf16' or 'fp32', not {wire!r}")
        self.wire = wire

    def _hook_for(self, tensor: torch.Tensor | None) -> CommHook:
        fallback = self.wire == "fp32" or (
            self.wire == "auto" and tensor is not None and tensor.is_cuda
            and dist.get_backend(self.process_group) == "gloo")
        return bf16_round_fp32_wire_hook if fallback else default_hooks.bf16_compress_hook

    def _reduce(self, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
        return _run_tapped(self._hook_for(bucket.buffer()), self.process_group, bucket)

    def comm_hook(self) -> tuple[Any, CommHook]:
        # DDP gives no tensor up front: `auto` picks the bf16 hook; pass wire="fp32" for gloo+CUDA.
        return self.process_group, self._hook_for(None)


class PowerSGDCompressor(GradientCompressor):
    """torch's PowerSGD hook on our buckets; all its behaviour lives in `state` (`PowerSGDState`).

    Per-parameter mode (default) compresses each gradient viewed as a matrix
    [shape[0], -1], so pass the gradient shapes in the `FlatBucket`; 1-D gradients and
    matrices not worth compressing (`min_compression_rate`) are all-reduced uncompressed.
    `batched=True` uses `batched_powerSGD_hook` (the whole bucket as one square matrix).
    Iterations below `start_iter` are vanilla all-reduces; the iteration count advances on
    buckets with `is_last=True`.
    """

    name = "powersgd"

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, rank: int = 1,
                 start_iter: int = 2, min_compression_rate: float = 2.0,
                 use_error_feedback: bool = True, warm_start: bool = True, seed: int = 0,
                 batched: bool = False) -> None:
        super().__init__(process_group)
        self.state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter, min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback, warm_start=warm_start, random_seed=seed)
        self.hook: CommHook = (powerSGD_hook.batched_powerSGD_hook if batched
                               else powerSGD_hook.powerSGD_hook)

    def _reduce(self, bucket: FlatBucket) -> tuple[torch.Tensor, int]:
        buffer = bucket.buffer()
        vanilla = self.state.iter < self.state.start_powerSGD_iter   # the hook's own test
        numel_before = self.state.total_numel_after_compression
        result = run_comm_hook(self.hook, self.state, bucket)
        numel = buffer.numel() if vanilla else self.state.total_numel_after_compression - numel_before
        return result, numel * buffer.element_size()

    def comm_hook(self) -> tuple[Any, CommHook]:
        return self.state, self.hook

    _COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")

    def state_dict(self) -> dict[str, Any]:
        """PowerSGDState's state: iteration and counters, error feedback and P/Q per bucket, and the
        numpy generator that draws a new bucket's first Q (its MT19937 state, keys as int64)."""
        rng_state = cast("tuple[str, Any, int, int, float]", self.state.rng.get_state())
        kind, keys, position, has_gauss, cached_gaussian = rng_state
        out: dict[str, Any] = {name: int(getattr(self.state, name)) for name in self._COUNTERS}
        out.update(rng_keys=torch.from_numpy(keys.astype("int64")), rng_position=int(position),
                   rng_has_gauss=int(has_gauss), rng_gaussian=float(cached_gaussian), rng_kind=str(kind))
        out.update(buckets_to_flat("error", self.state.error_dict))
        out.update(buckets_to_flat("p", self.state.p_memory_dict))
        out.update(buckets_to_flat("q", self.state.q_memory_dict))
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` of a compressor on the same group and buckets."""
        for name in self._COUNTERS:
            setattr(self.state, name, int(state[name]))
        keys = state["rng_keys"].cpu().numpy().astype("uint32")
        self.state.rng.set_state((state["rng_kind"], keys, int(state["rng_position"]),
                                  int(state["rng_has_gauss"]), float(state["rng_gaussian"])))
        self.state.error_dict = buckets_from_flat("error", state)
        self.state.p_memory_dict = buckets_from_flat("p", state)
        self.state.q_memory_dict = buckets_from_flat("q", state)
