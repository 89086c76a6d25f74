"""Gradient synchronisation of the emitted program: one plan gradient group at a time, with the
group's compressor, summing over the group's ranks.

Losses are pre-weighted by rows / global batch, so the update needs the SUM of a parameter's
gradients over its holders (replicas, and stages sharing a tied weight):

  none        one flat fp32 SUM all-reduce per group (comm.allreduce_sum_): bit-exact, as before
  compressed  the group's gradients in buckets (costmodel.compression.bucket_ranges), each averaged
              by the group's compressor (backends.compression: fp16 / bf16 / PowerSGD / 1-bit), then
              multiplied by the group size: mean x k = sum

Each group has its own compressor, created once, so its state (error feedback, PowerSGD's P/Q and
iteration count) persists across steps; buckets are keyed by their index within the group.
Wire bytes are measured, not computed: the flat buffer of the `none` all-reduce, the
compressors' own counters otherwise (payload this rank hands to collectives, see
backends.compression.wire).

Under AdamW a `onebit` group trains with 1-bit Adam (backends.compression.onebit_adam):
`momentum_exchanges()` hands the group's 1-bit compressor to the optimizer, after which the group's
gradients are summed exactly while the optimizer warms up, and not at all once it exchanges
compressed momentum instead (`sync(skip=...)`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from backends.compression import GradientCompressor, MomentumExchange, make_compressor
from backends.torchdist.comm import allreduce_sum_
from costmodel import compression as costs
from planner.core.ir import GradGroup


def compressor_options(name: str) -> dict[str, Any]:
    """Constructor options of compressor `name`: the values the cost model assumes."""
    if name == "powersgd":
        return {"rank": costs.POWERSGD_RANK, "start_iter": costs.POWERSGD_START_ITER,
                "min_compression_rate": costs.POWERSGD_MIN_COMPRESSION_RATE}
    return {}


@dataclass
class _Group:
    plan: GradGroup
    process_group: dist.ProcessGroup | None
    params: list[nn.Parameter]
    compressor: GradientCompressor | None            # None: the exact `none` path
    buckets: list[tuple[int, int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.plan.ranks)


class GradientSync:
    """This rank's gradient groups and their compressors; `sync()` once per step."""

    def __init__(self, groups: list[GradGroup], process_groups: Mapping[int, dist.ProcessGroup | None],
                 params: Mapping[str, nn.Parameter]) -> None:
        self.groups: list[_Group] = []
        for group in groups:
            if group.index not in process_groups:
                continue
            pg = process_groups[group.index]
            members = [params[name] for name in group.params]
            compressor = None
            if group.compressor != "none":
                compressor = make_compressor(group.compressor, pg, **compressor_options(group.compressor))
            buckets = costs.bucket_ranges([p.numel() for p in members],
                                          costs.GRAD_BUCKET_CAP_BYTES // costs.FP32_BYTES)
            self.groups.append(_Group(group, pg, members, compressor, buckets))
        self.bytes_reduced = 0
        self.wire_bytes_by_group: dict[int, int] = {}
        self.exchanges: list[MomentumExchange] = []     # handed out by `momentum_exchanges`

    @property
    def wire_bytes(self) -> int:
        """Measured payload bytes this rank handed to gradient collectives in the last `sync`."""
        return sum(self.wire_bytes_by_group.values())

    def momentum_exchanges(self) -> list[tuple[list[nn.Parameter], MomentumExchange]]:
        """For 1-bit Adam: each `onebit` group's parameters and a momentum exchange that takes over its
        1-bit compressor (and buckets); the group's gradients are summed exactly from now on, unless
        `sync` is told to skip the group. Call once, before the first `sync`."""
        handed = []
        for group in self.groups:
            if group.plan.compressor != "onebit" or group.compressor is None:
                continue
            exchange = MomentumExchange(group.compressor, group.buckets, gradient_scale=float(group.size),
                                        key=group.plan.index)
            group.compressor = None
            handed.append((group.params, exchange))
            self.exchanges.append(exchange)
        return handed

    def sync(self, skip: Collection[int] = ()) -> None:
        """Replace every held gradient by its sum over the group (compressed where the plan says),
        except in the groups whose plan index is in `skip` (their momentum is exchanged instead)."""
        self.bytes_reduced = 0
        self.wire_bytes_by_group = {}
        for group in self.groups:
            if group.plan.index in skip:
                self.wire_bytes_by_group[group.plan.index] = 0
                continue
            grads = []
            for p in group.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
            if group.compressor is None:
                # the flat buffer handed to all_reduce is the wire payload (a CollectiveTap here would
                # route every copy through Python: 2.5x slower on 49 tensors)
                wire = allreduce_sum_(grads, group.process_group)
                self.bytes_reduced += wire
            else:                                   # mean over the group x its size = sum
                wire = group.compressor.allreduce_mean_buckets_(grads, group.buckets, multiplier=group.size)
                self.bytes_reduced += sum(g.numel() * g.element_size() for g in grads)
            self.wire_bytes_by_group[group.plan.index] = wire


def group_payload_bytes(group: GradGroup, shapes: Mapping[str, tuple[int, ...]]) -> float:
    """The cost model's payload per rank per step for `group` with its compressor (steady state).

    `shapes` maps parameter names to shapes (e.g. from the model); the figure `sync` measures.
    """
    volume = costs.GradVolume(group.nbytes, tuple(tuple(shapes[p]) or (1,) for p in group.params))
    return costs.compress_volume(group.compressor, volume).payload_bytes if len(group.ranks) > 1 else 0.0
