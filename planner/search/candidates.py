"""What the search chooses among and what it returns: a candidate configuration (one pipeline shape
with its stage split), a choice of replicas of one, and a solution (the chosen replicas with their
estimates and the solver's facts). Plain records: every strategy builds them, `assemble` reads them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.tables import ClassTable
from planner.core.units import NS_PER_S
from planner.search import interleave, zero_bubble
from planner.search.pipeline import pipeline_one_s, pipeline_s, table_size
from planner.search.split import Split


def pipeline_optimizer_s(stage_tables: Sequence[ClassTable], bounds: Sequence[int]) -> float:
    """A pipeline's optimizer step: its slowest stage's, each parameter of a stage stepped once
    (ClassTable.held_optimizer_s); stage s holds blocks bounds[s]..bounds[s + 1] on stage_tables[s]."""
    return max(t.held_optimizer_s([range(bounds[s], bounds[s + 1])]) for s, t in enumerate(stage_tables))


@dataclass(frozen=True)
class Config:
    cls: int
    num_stages: int
    micro_batch: int
    split: Split
    optimizer_s: float
    intra_node: bool            # the whole pipeline sits inside one node
    # per stage, when the pipeline spans device classes (planner.search.hetero); else all `cls`
    stage_classes: tuple[int, ...] = ()
    schedule: str = "1f1b"          # one of planner.core.schedule.SCHEDULES
    # GPipe keeps every micro-batch's activations: the most micro-batches that fit (None: no limit)
    max_micro_batches: int | None = None
    # per stage: the gradient compressors whose state fits beside its peak memory, decided by
    # planner.search.compressors (None: not restricted, as without gradient compression)
    stage_compressors: tuple[tuple[str, ...], ...] | None = None
    # interleaved 1F1B (planner.search.interleave_configs): each device runs this many of the stages,
    # stage k on device k mod (num_stages / chunks)
    chunks: int = 1
    # zbh1 (planner.search.schedules): per stage, the weight gradients' part of its backward per
    # micro-batch (of split.bwd_s), which the schedule runs apart
    stage_wgrad_s: tuple[float, ...] = ()

    @property
    def classes(self) -> tuple[int, ...]:
        """The device class of each stage."""
        return self.stage_classes or (self.cls,) * self.num_stages

    @property
    def device_classes(self) -> tuple[int, ...]:
        """The device class of each device of a replica, in pipeline order."""
        return self.classes[:self.num_stages // self.chunks]

    def devices_of(self, cls: int) -> int:
        """Devices of class `cls` one replica takes."""
        return self.device_classes.count(cls)

    @property
    def shape(self) -> tuple[int, ...]:
        """What a replica occupies: the class of each device (a single class's shape is (c,) * S), and
        under interleaved 1F1B its stages per device as a last entry, -chunks (`shape_devices`)."""
        return self.classes if self.chunks == 1 else (*self.device_classes, -self.chunks)

    def replica_time_s(self, micro_batches: int) -> float:
        """One replica's iteration with M micro-batches: its schedule's makespan
        (planner.search.pipeline, planner.search.interleave), then the optimizer. Computed for this count
        alone (pipeline_one_s): the same number as replica_time_ns' table of every count gives."""
        sp = self.split
        if self.schedule == "interleaved":
            return interleave.makespan_s(sp.fwd_s, sp.bwd_s, sp.send_s, self.chunks, micro_batches) + self.optimizer_s
        if self.schedule == "zbh1":       # replayed at this count: the simulator's figure
            return zero_bubble.makespan_s(sp.fwd_s, sp.bwd_s, self.stage_wgrad_s, sp.send_s,
                                          micro_batches) + self.optimizer_s
        return pipeline_one_s(sp.fwd_s, sp.bwd_s, sp.send_s, micro_batches, self.schedule) + self.optimizer_s

    def micro_batch_counts(self, global_batch: int, most: int) -> list[int]:
        """The micro-batch counts a replica of this configuration may run: up to `most`, no more than
        the global batch needs, within the schedule's memory, and whole rounds under interleaved 1F1B."""
        limit = min(most, math.ceil(global_batch / self.micro_batch))
        if self.max_micro_batches is not None:
            limit = min(limit, self.max_micro_batches)
        if self.schedule == "interleaved":     # counts whose rows it can run (the batch's own rows at most)
            devices = self.num_stages // self.chunks
            return [M for M in interleave.counts(devices, limit)
                    if M * self.micro_batch <= global_batch or
                    interleave.split_rows(devices, global_batch, self.micro_batch) is not None]
        return list(range(1, limit + 1))

    def micro_batch_sizes(self, rows: int) -> tuple[int, ...]:
        """A replica's `rows` as the micro-batches it runs: micro_batch each and the rest in one more, or
        under interleaved 1F1B a count that fills whole rounds (interleave.split_rows; an empty tuple where
        none does)."""
        if self.schedule == "interleaved":
            return interleave.split_rows(self.num_stages // self.chunks, rows, self.micro_batch) or ()
        full, rest = divmod(rows, self.micro_batch)
        return tuple([self.micro_batch] * full + ([rest] if rest else []))

    def replica_time_ns(self, micro_batches: int) -> int:
        """replica_time_s on the solver's clock, read from the pipeline's table of every count (the
        solver asks for each count up to the batch's)."""
        sp = self.split
        if self.schedule == "interleaved":
            return to_ns(self.replica_time_s(micro_batches))
        if self.schedule == "zbh1":       # the table of every count, interpolated past the first (zero_bubble)
            table = zero_bubble.makespans_s(sp.fwd_s, sp.bwd_s, self.stage_wgrad_s, sp.send_s,
                                            table_size(micro_batches))
            return to_ns(float(table[micro_batches]) + self.optimizer_s)
        return to_ns(pipeline_s(sp.fwd_s, sp.bwd_s, sp.send_s, micro_batches, self.schedule) + self.optimizer_s)


def shape_devices(shape: tuple[int, ...]) -> int:
    """Devices one replica of `shape` (Config.shape) takes."""
    return sum(1 for c in shape if c >= 0)


def shape_chunks(shape: tuple[int, ...]) -> int:
    """Stages per device of `shape` (Config.shape): 1 but under interleaved 1F1B."""
    return -shape[-1] if shape and shape[-1] < 0 else 1


@dataclass(frozen=True)
class Choice:
    config: Config
    replicas: int
    share: int                  # samples per replica before trimming the excess


@dataclass(frozen=True)
class Solution:
    choices: tuple[Choice, ...]
    pipeline_s: float
    sync_s: float
    objective_s: float
    bound_s: float
    status: str
    configurations: int
    one_node: bool


def to_ns(seconds: float) -> int:
    """Seconds on the solver's integer clock (nanoseconds, never negative)."""
    return max(0, round(seconds * NS_PER_S))
