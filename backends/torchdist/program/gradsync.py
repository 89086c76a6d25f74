"""Gradient synchronisation of the emitted program: one plan gradient group at a time, with the
group's compressor, summing over the group's ranks.

Losses are pre-weighted by rows / global batch, so the update needs the SUM of a parameter's
gradients over its holders (replicas, and stages sharing a tied weight):

  none        one flat fp32 SUM all-reduce per group (allreduce_sum_): bit-exact
  compressed  the group's gradients in buckets (the plan's GradGroup.settings), each averaged by
              the group's compressor (backends.compression: fp16 / bf16 / PowerSGD / 1-bit, run with
              the settings the plan records), then multiplied by the group size: mean x k = sum

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

import torch
import torch.distributed as dist
import torch.nn as nn

from backends.compression import GradientCompressor, MomentumExchange, make_compressor
from costmodel import compression as costs
from planner.core.errors import PlanFileError
from planner.core.ir import GradGroup


def allreduce_sum_(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> int:
    """Sum `tensors` across the group in one flat buffer; returns the bytes reduced."""
    if not tensors:
        return 0
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
    return flat.numel() * flat.element_size()


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
            compressor, buckets = None, []
            if group.compressor != "none":
                if group.settings is None:
                    raise PlanFileError(f"gradient group {group.index} uses {group.compressor} without its "
                                        "settings (a plan from an earlier hetplan)", field="grad_groups.settings",
                                        fix="re-plan with this hetplan version")
                compressor = make_compressor(group.compressor, pg, group.settings)
                buckets = group.settings.bucket_ranges([p.numel() for p in members])
            self.groups.append(_Group(group, pg, members, compressor, buckets))
        self.bytes_reduced = 0
        self.wire_bytes_by_group: dict[int, int] = {}
        self.exchanges: list[MomentumExchange] = []     # handed out by `momentum_exchanges`

    @property
    def wire_bytes(self) -> int:
        """Measured payload bytes this rank handed to gradient collectives in the last `sync`."""
        return sum(self.wire_bytes_by_group.values())

    def reset_counters(self) -> None:
        """Start a step's counts: gradient bytes reduced, wire bytes per group, momentum exchanged."""
        self.bytes_reduced = 0
        self.wire_bytes_by_group = {}
        for exchange in self.exchanges:
            exchange.reset_counters()

    def step_grad_bytes(self) -> int:
        """Gradient bytes (uncompressed) synchronised this step (1-bit Adam's groups: their momentum)."""
        return self.bytes_reduced + sum(e.exchanged_bytes for e in self.exchanges)

    def step_wire_bytes_by_group(self) -> dict[int, int]:
        """Measured payload bytes per gradient group this step: gradients or 1-bit Adam's momentum."""
        merged = dict(self.wire_bytes_by_group)
        for exchange in self.exchanges:
            if exchange.wire_bytes:
                merged[exchange.key] = merged.get(exchange.key, 0) + exchange.wire_bytes
        return merged

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

    def compressors(self) -> dict[int, GradientCompressor]:
        """Plan group index -> the compressor whose state carries across steps (PowerSGD's P/Q and error
        feedback, 1-bit error feedback), also those handed to 1-bit Adam's momentum exchanges: what a
        checkpoint saves per group and rank."""
        held = {group.plan.index: group.compressor for group in self.groups if group.compressor is not None}
        held.update({exchange.key: exchange.compressor for exchange in self.exchanges})
        return held

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
    return costs.compress_volume(group.compressor, volume, group.settings).payload_bytes if len(group.ranks) > 1 \
        else 0.0
