"""Records of a plan that stand apart from its replicas and stages (planner.core.ir): what a gradient
group's compressor runs with (`CompressorSettings`), and what a plan carries beside its decisions
(`Plan.lineage`, `Plan.checkpoint`: written to plan.json and read back, but two plans that decide the same
are equal with or without them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

OPTIONAL = {"omit_default": True}    # field metadata: left out of the file at its default (planner.core.ir)


def bucket_ranges(numels: Sequence[int], cap_elems: int) -> list[tuple[int, int]]:
    """Cut parameters (in order) into buckets of at most `cap_elems` elements ([start, stop) indices).

    A parameter larger than the cap gets a bucket of its own. The cost model prices gradient groups
    bucketed this way and the program buckets them the same way (CompressorSettings.bucket_ranges).
    """
    ranges: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, numel in enumerate(numels):
        if i > start and size + numel > cap_elems:
            ranges.append((start, i))
            start, size = i, 0
        size += numel
    if numels:
        ranges.append((start, len(numels)))
    return ranges


@dataclass(frozen=True)
class CompressorSettings:
    """What a gradient group's compressor runs with: the values the cost model priced it with, recorded
    so that the program reads them from the plan (a later change of the cost model's defaults leaves
    an emitted program as it was). Fields a compressor does not use stay at their default, unwritten."""

    bucket_cap_bytes: int                  # fp32 gradients travel in buckets of at most this many bytes
    rank: int = field(default=0, metadata=OPTIONAL)                        # powersgd: approximation rank
    min_compression_rate: float = field(default=0.0, metadata=OPTIONAL)   # powersgd: compress a matrix
    #                                          only if it shrinks at least this much
    start_iter: int = field(default=0, metadata=OPTIONAL)                  # powersgd: exact steps first
    warmup_fraction: float = field(default=0.0, metadata=OPTIONAL)         # onebit under AdamW (1-bit
    #                                          Adam): exact AdamW for this fraction of the run's steps

    FP32_BYTES: ClassVar[int] = 4          # gradients are bucketed as fp32

    def bucket_ranges(self, numels: Sequence[int]) -> list[tuple[int, int]]:
        """[start, stop) ranges of a group's parameters (element counts `numels`, in order), one per bucket."""
        return bucket_ranges(numels, self.bucket_cap_bytes // self.FP32_BYTES)


@dataclass(frozen=True)
class Lineage:
    """What a re-planned plan replaces (`plan replan`): the plan directory it was made from, that plan's
    digest, the devices lost since it, and the spec it was planned on."""

    plan_dir: str                 # the replaced plan's directory, resolved
    plan_digest: str              # sha256 of the replaced plan's plan.json
    without: tuple[str, ...]      # device labels removed since that plan (`--without`)
    cluster: str                  # the spec planned on (the replaced plan's, or `--cluster`'s), resolved


@dataclass(frozen=True)
class CheckpointAdvice:
    """How long a checkpoint takes under this plan and how often to take one (costmodel.checkpoint).

    A record beside the plan's decisions, not one of them: Young/Daly's interval from the blocking cost
    of one save and the job's mean time between failures (none when no device of the plan has one)."""

    state_bytes: float            # the largest rank's checkpoint: parameters + optimizer state
    state_rank: int               # that rank
    blocking_s: float             # the step's pause: staging a copy of each rank's state (slowest rank)
    write_s: float                # the background write to storage (busiest node)
    storage_write_bytes_s: float  # per node, the spec's `storage.write_gbyte_s` or the catalog placeholder
    storage_source: str           # where that figure comes from
    devices_with_mtbf: int        # ranks whose device type gives mtbf_hours
    job_mtbf_s: float | None = None      # 1 / sum over those devices of 1 / MTBF
    interval_s: float | None = None      # sqrt(2 x blocking_s x job_mtbf_s), at least write_s
    interval_steps: int | None = None    # interval_s in the plan's estimated steps, at least 1
