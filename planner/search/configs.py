"""The candidate configurations the search chooses among: per (device class, stage count,
micro-batch size) the best stage split (planner.search.split), shared splits across classes
(align), pipelines across two classes (hetero), and each under 1F1B and, where it fits, GPipe
(schedules) and interleaved 1F1B on fewer devices (interleave_configs), with the gradient compressors
each stage has the memory for (compressors)."""

from __future__ import annotations

from costmodel.tables import CostTables
from planner.search import align, hetero, schedules
from planner.search.candidates import Config, pipeline_optimizer_s, shape_devices
from planner.search.compressors import with_compressor_room
from planner.search.interleave_configs import with_interleaved
from planner.search.split import Split
from planner.search.sync import drain_overlap_s

MAX_STAGES = 128
# mixed pipelines multiply the replica shapes: offered on clusters up to this size (128 made the 128-GPU
# search 24 s), or at any size when nothing else fits
MIXED_MAX_DEVICES = 64


def micro_batch_options(global_batch: int, limit: int = 64) -> list[int]:
    out, m = [], 1
    while m <= min(global_batch, limit):
        out.append(m)
        m *= 2
    return out


def stage_count_options(num_blocks: int, num_devices: int, per_node: int,
                        fixed: int | None) -> list[int]:
    if num_devices <= 0 or per_node <= 0:     # a class with no devices at this tensor-parallel degree
        return []
    if fixed is not None:
        return [fixed] if fixed <= min(num_blocks, num_devices) else []
    options = {s for s in range(1, per_node + 1) if per_node % s == 0}
    s = per_node * 2
    while s <= min(num_devices, MAX_STAGES):
        options.add(s)
        s *= 2
    return sorted(o for o in options if o <= min(num_blocks, num_devices))


def build_configs(tables: CostTables, fixed_stages: int | None = None,
                  fixed_micro_batch: int | None = None, mixed_pipelines: bool = True,
                  schedule: str = "auto") -> list[Config]:
    """Per (class, stage count, micro-batch size) a configuration with its stage split: per stage
    count one split shared by the classes where it fits (aligned gradient groups, planner.search.align);
    and pipelines whose stages span two classes (planner.search.hetero). Each runs 1F1B and, as far as
    its memory holds GPipe's micro-batches, GPipe, and where its devices hold it, interleaved 1F1B on a half
    or a quarter of its devices (`schedule`: "auto" all of them, else that one only; "interleaved" lets its
    devices recompute where they must, planner.search.interleave_configs)."""
    micro_options = [fixed_micro_batch] if fixed_micro_batch else micro_batch_options(tables.global_batch)
    by_stages: dict[int, list[int]] = {}
    for ci, table in enumerate(tables.classes):
        for S in stage_count_options(tables.num_blocks, table.num_devices, table.per_node, fixed_stages):
            by_stages.setdefault(S, []).append(ci)
    configs: list[Config] = []
    shared_by_stages = {}
    for S, classes in sorted(by_stages.items()):
        own = align.own_splits(tables, classes, S, micro_options)
        shared = align.shared_bounds(tables, classes, S, micro_options, own)
        if shared is not None and S > 1:
            shared_by_stages[S] = shared
        for ci in classes:
            configs.extend(make_config(tables, ci, split, m)
                           for m, split in align.class_splits(tables, ci, S, micro_options, shared, own))
    # mixed pipelines multiply the replica shapes; on large clusters every class has devices enough
    # for its own pipelines, so they are offered there only when no single-class pipeline fits
    # (GPUs counted: at a tensor-parallel degree t a table's "device" is t of them, costmodel.tensor_parallel,
    # and counting groups would open the gate at TP on clusters of 128 to 512 GPUs: 460 s at 128)
    gpus = sum(t.num_devices * t.tp_degree for t in tables.classes)
    if mixed_pipelines and (not configs or gpus <= MIXED_MAX_DEVICES):
        configs.extend(hetero.mixed_configs(tables, shared_by_stages, micro_options, fixed_stages))
    # each configuration's stages: which gradient compressors' state fits beside their peak memory
    scheduled = schedules.with_schedules(tables, configs, schedule) if schedule != "interleaved" else []
    if schedule in ("auto", "interleaved"):
        scheduled += with_interleaved(tables, configs, fixed_stages, micro_options, recompute=schedule == "interleaved")
    configs = with_compressor_room(tables, scheduled)
    return sorted(configs, key=lambda c: (c.cls, c.num_stages, c.micro_batch, c.classes, c.schedule != "1f1b",
                                          c.schedule, c.chunks))


def make_config(tables: CostTables, cls: int, split: Split, micro_batch: int) -> Config:
    table, S = tables.classes[cls], split.num_stages
    opt = pipeline_optimizer_s([table] * S, split.bounds)
    return Config(cls, S, micro_batch, split, opt, S <= table.per_node)


def overlap_of(tables: CostTables, configs: list[Config], shape: tuple[int, ...],
               bounds: tuple[int, ...]) -> list[float]:
    """How early each stage of this split may start its sync (planner.search.sync.drain_overlap_s),
    at the smallest micro-batch size any configuration of this shape and split uses (the least overlap).
    Under interleaved 1F1B, per device: after a device's last backward (its first stage's, of the last
    micro-batch) the devices before it drain their first stages', as under 1F1B on the first D stages."""
    micro = min(c.micro_batch for c in configs if c.shape == shape and c.split.bounds == bounds)
    devices = shape_devices(shape)
    return drain_overlap_s(tables, shape[:devices], bounds[:devices + 1], micro)
