"""The costed problem: every number the search needs, as plain tuples of floats.

Rows are device classes (one per node group of the spec), columns are blocks. Times are per
sample (compute scales with the micro-batch) plus a fixed per-micro-batch overhead; bytes are
per block. The search never sees torch objects or the spec, only these tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from costmodel import calibrated, compute, memory
from costmodel import constants as C
from costmodel.calibration import Calibration
from planner.core.blocks import Block, BlockSharding
from planner.core.cluster import ClusterSpec, Link


@dataclass(frozen=True)
class ClassTable:
    """Costs of every block on one device class (the devices of one node group)."""

    name: str
    device_type: str
    num_devices: int
    per_node: int
    num_nodes: int
    precision: str
    capacity_bytes: float            # memory per device x (1 - margin): what a stage may need (memory.fits)
    fwd_s: tuple[float, ...]         # per block, per sample
    bwd_s: tuple[float, ...]         # per block, per sample
    overhead_s: tuple[float, ...]    # per block, per micro-batch (fwd + bwd launches)
    state_bytes: tuple[float, ...]   # per block: weights, grads, optimizer state
    act_bytes: tuple[float, ...]     # per block, per sample: activations kept for backward
    boundary_bytes: tuple[float, ...]  # per block, per sample: what a cut after it sends
    optimizer_s: tuple[float, ...]   # per block: optimizer step time
    intra_bandwidth_bytes_s: float
    intra_latency_s: float
    price_per_hour: float | None = None
    framework_bytes: float = 0.0     # per process besides its stage's state and activations: the framework's
    #                                  own memory and the largest gradient's transient (part of every stage's need)
    tp_degree: int = 1               # a "device" here is this many devices of one node (costmodel.tensor_parallel)
    # a collective among a node's devices (tensor parallelism's all-reduces), (bandwidth, latency per ring
    # hop), where it is not the intra link's point-to-point figures (costmodel.calibrated.collective_link)
    collective: tuple[float, float] | None = None
    zero_group: int = 1              # optimizer state sharded over >= this many replicas (costmodel.sharded_state)
    # per block, per sample: the backward's working set where the block is a stage's largest (memory.
    # backward_transient_bytes); a stage holds its blocks' largest once per micro-batch. () in synthetic tables: none
    transient_bytes: tuple[float, ...] = ()
    # a tied parameter's state counted again by its next reader: (a reader block, the next reader block, the
    # parameter's state bytes in state_bytes); a device holding both holds one copy (`held_state_bytes`)
    tied_state: tuple[tuple[int, int, float], ...] = ()
    # likewise its optimizer step: (a reader block, the next reader block, one copy's seconds in optimizer_s);
    # the optimizer steps each parameter once however many blocks read it (`held_optimizer_s`)
    tied_optimizer_s: tuple[tuple[int, int, float], ...] = ()

    def held_state_bytes(self, ranges: Iterable[range]) -> float:
        """The training state of a device holding the blocks of `ranges` (one stage's, or each chunk's under
        interleaved 1F1B): every block's, less each tied parameter counted again by a reader it also holds."""
        return _held(self.state_bytes, self.tied_state, ranges)

    def held_optimizer_s(self, ranges: Iterable[range]) -> float:
        """The optimizer step of a device holding the blocks of `ranges`, as `held_state_bytes` counts its
        state: every block's, less each tied parameter stepped again for a reader it also holds."""
        return _held(self.optimizer_s, self.tied_optimizer_s, ranges)

    @property
    def intra_link(self) -> Link:
        """The link between this class's devices of one node (point-to-point figures)."""
        return Link("intra", self.intra_bandwidth_bytes_s, self.intra_latency_s)

    @property
    def collective_link(self) -> Link:
        """The link a ring collective among this class's devices of one node runs at (per-hop latency)."""
        return self.intra_link if self.collective is None else Link("intra", *self.collective)

    @property
    def model_bytes(self) -> float:
        """Memory per device left for the model (state, activations, compressor state): capacity less
        the framework's."""
        return self.capacity_bytes - self.framework_bytes


def _held(per_block: tuple[float, ...], tied: tuple[tuple[int, int, float], ...], ranges: Iterable[range]) -> float:
    """`per_block` summed over `ranges`, less each tied pair's copy where the ranges hold both its readers."""
    ranges = list(ranges)
    total = sum(sum(per_block[r.start:r.stop]) for r in ranges)
    return total - sum(x for a, b, x in tied if any(a in r for r in ranges) and any(b in r for r in ranges))


def output_bytes(last: Block) -> float:
    """Bytes of the model's output at the trace batch: the last block's last computed value."""
    computed = [o.out_bytes for o in last.ops if o.op_class != "view"]
    return computed[-1] if computed else 0.0


@dataclass(frozen=True)
class CostTables:
    global_batch: int
    num_blocks: int
    classes: tuple[ClassTable, ...]
    grad_bytes: tuple[float, ...]    # per block: gradient bytes synchronised across replicas
    inter_bandwidth_bytes_s: float
    inter_latency_s: float
    block_signatures: tuple[str, ...] = ()
    # parameters read by more than one block (tied weights): (those blocks, bytes); each block's
    # grad_bytes counts them too
    tied: tuple[tuple[tuple[int, ...], float], ...] = ()
    memory_margin: float = C.DEFAULT_MEMORY_MARGIN   # the capacities' margin, recorded in the plan
    # per block: what tensor parallelism splits (passes.tensor_parallel; () where not analysed: none);
    # costmodel.tensor_parallel prices it at a degree
    shardings: tuple[BlockSharding, ...] = ()
    param_tensors: tuple[int, ...] = ()     # per block: its parameter tensors (() where not counted: one each)
    # per block: the part of its backward that computes weight gradients (Block.wgrad_fraction), which a
    # zero-bubble schedule runs apart; () where not counted (no zero-bubble configurations)
    wgrad_fraction: tuple[float, ...] = ()


def build_tables(blocks: list[Block], spec: ClusterSpec, *, global_batch: int, trace_batch: int,
                 precision_policy: str = "auto", memory_margin: float = C.DEFAULT_MEMORY_MARGIN,
                 calibration: Calibration | None = None) -> CostTables:
    """Cost every block on every node group's device type.

    Block op counts come from a trace at `trace_batch` samples; compute and activations are
    divided by it to give per-sample figures. A `calibration` replaces datasheet figures for the
    device type it measured (`costmodel.calibrated`).
    """
    classes = []
    for group in spec.nodes:
        dev = group.device
        prec = compute.best_precision(dev, precision_policy)
        byte_scale = C.BYTES_PER_ELEMENT[prec] / 4.0
        fwd = tuple(compute.ops_time_s(b.ops, dev, prec, False, calibration) / trace_batch for b in blocks)
        bwd = tuple(compute.ops_time_s(b.ops, dev, prec, True, calibration) / trace_batch for b in blocks)
        over = tuple(compute.ops_overhead_s(b.ops, dev, calibration) for b in blocks)
        if calibration is not None and calibration.matches(dev):
            fwd, bwd, over = calibrated.scale_to_model_timing(blocks, fwd, bwd, over, dev, calibration)
        state = tuple(memory.state_bytes(b.param_bytes, prec) for b in blocks)
        transient = memory.gradient_transient_bytes(max((size for b in blocks for size in b.param_sizes), default=0.0))
        act = tuple(b.activation_bytes * byte_scale / trace_batch for b in blocks)
        if blocks:      # the loss runs after the last block, on the last stage: its memory is that block's
            act = act[:-1] + (act[-1] + memory.loss_bytes(output_bytes(blocks[-1]) * byte_scale / trace_batch),)
        boundary = tuple(b.boundary_bytes * byte_scale / trace_batch for b in blocks)
        working = tuple(memory.backward_transient_bytes(b.largest_output_bytes) * byte_scale / trace_batch
                        for b in blocks)
        opt = tuple(compute.optimizer_step_s(b.param_bytes, len(b.params), dev, calibration) for b in blocks)
        if calibration is not None and calibration.matches(dev):
            opt = calibrated.with_step_costs(opt, blocks, global_batch, calibration)
        capacity = memory.usable_bytes(dev, memory_margin)
        intra = calibrated.intra_link(group.intra_link, dev, calibration)
        ring = calibrated.collective_link(group.intra_link, dev, calibration)
        classes.append(ClassTable(
            name=group.name, device_type=dev.name, num_devices=group.count * group.per_node,
            per_node=group.per_node, num_nodes=group.count, precision=prec, capacity_bytes=capacity,
            framework_bytes=memory.framework_bytes(dev, calibration) + transient,
            fwd_s=fwd, bwd_s=bwd, overhead_s=over, state_bytes=state, act_bytes=act,
            boundary_bytes=boundary, optimizer_s=opt, transient_bytes=working,
            intra_bandwidth_bytes_s=intra.bandwidth_bytes_s,
            intra_latency_s=intra.latency_s, price_per_hour=dev.price_per_hour,
            collective=None if ring is None else (ring.bandwidth_bytes_s, ring.latency_s),
            tied_state=tuple((a, b, memory.state_bytes(nbytes, prec)) for a, b, nbytes in tied_pairs(blocks)),
            tied_optimizer_s=tuple((a, b, compute.optimizer_step_s(nbytes, 1, dev, calibration))
                                   for a, b, nbytes in tied_pairs(blocks))))
    inter: Link = calibrated.inter_link(spec, calibration)
    return CostTables(
        global_batch=global_batch, num_blocks=len(blocks), classes=tuple(classes),
        grad_bytes=tuple(b.param_bytes for b in blocks),
        inter_bandwidth_bytes_s=inter.bandwidth_bytes_s,
        inter_latency_s=inter.latency_s,
        block_signatures=tuple(b.signature for b in blocks), tied=tied_parameters(blocks),
        param_tensors=tuple(len(b.params) for b in blocks),
        wgrad_fraction=tuple(b.wgrad_fraction for b in blocks),
        memory_margin=memory_margin)


def tied_pairs(blocks: list[Block]) -> tuple[tuple[int, int, float], ...]:
    """Each tied parameter's consecutive readers, with its fp32 bytes: a contiguous range of blocks holding
    k of its readers holds k - 1 of these pairs, the copies it counts too many."""
    return reader_pairs(tied_parameters(blocks))


def reader_pairs(tied: tuple[tuple[tuple[int, ...], float], ...]) -> tuple[tuple[int, int, float], ...]:
    """`tied_pairs` of parameters given as `CostTables.tied` holds them: (readers, fp32 bytes)."""
    return tuple((readers[i], readers[i + 1], nbytes) for readers, nbytes in tied for i in range(len(readers) - 1))


def tied_parameters(blocks: list[Block]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """Parameters several blocks read, with the blocks and the parameter's bytes."""
    readers: dict[str, list[int]] = {}
    size: dict[str, float] = {}
    for i, b in enumerate(blocks):
        for p, nbytes in zip(b.params, b.param_sizes):
            readers.setdefault(p, []).append(i)
            size[p] = nbytes
    return tuple((tuple(r), size[p]) for p, r in sorted(readers.items()) if len(r) > 1)
