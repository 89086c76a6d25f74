"""Where a calibration replaces figures in the cost tables beyond per-op compute: links between
processes of the calibrated host, and a measured whole-model timing.

`plan profile` measures gloo between two processes of one host. Those figures describe the links
among CPU devices of that host: the intra-node link of a calibrated CPU node group (used for
point-to-point inside a node) and a `loopback` network (used for gradient synchronisation across
node groups). They say nothing about NVLink or a real network, so GPU calibrations leave links alone.
"""

from __future__ import annotations

from costmodel.calibration import Calibration, ModelTiming, model_key
from planner.core.blocks import Block
from planner.core.cluster import ClusterSpec, DeviceType, Link

HOST_LOCAL_NETWORK = "loopback"


def intra_link(link: Link, device: DeviceType, calibration: Calibration | None) -> Link:
    """The node group's intra-node link: measured point-to-point when the host's processes are the devices."""
    if calibration is None or calibration.kind != "cpu" or not calibration.matches(device):
        return link
    return calibration.p2p_link(link.kind)


def collective_link(link: Link, device: DeviceType, calibration: Calibration | None) -> Link | None:
    """The link a ring collective among a node group's devices runs at, where it is not `link`'s
    point-to-point figures: when the host's processes are the devices, the all-reduce microbenchmark's
    ring (Calibration.call_ring_link), since an all-reduce call costs far more than a message (here, 4
    processes on 2 cores: 0.85 ms per ring hop, 0.48 ms one way for a message). benchmarks/
    fidelity_collectives.py, 2026-12-02: on this ring tensor parallelism's all-reduces in a step are priced
    15-50% below what they measure; on the message figures they were 3-10x too low, and with the in-situ
    factor the gradient sync gets (x2.8) 1.5-3x too high. None: the intra link serves (NVLink, PCIe)."""
    if calibration is None or calibration.kind != "cpu" or not calibration.matches(device):
        return None
    return calibration.call_ring_link(link.kind)


def inter_link(spec: ClusterSpec, calibration: Calibration | None) -> Link:
    """The network between nodes: a `loopback` network of calibrated CPU devices is the host itself, so the
    measured all-reduce (as a ring link) replaces the spec's figures; anything else is kept."""
    network = spec.inter_node
    if calibration is None or calibration.kind != "cpu" or network.kind != HOST_LOCAL_NETWORK:
        return network
    if not all(calibration.matches(g.device) for g in spec.nodes):
        return network
    return calibration.ring_link(network.kind)


Times = tuple[float, ...]


def scale_to_model_timing(blocks: list[Block], fwd_s: Times, bwd_s: Times, overhead_s: Times,
                          device: DeviceType, calibration: Calibration) -> tuple[Times, Times, Times]:
    """When the calibration timed this very model, rescale the op-class estimates so their totals equal
    the measurement: per-sample forward, per-sample backward and per-micro-batch overhead each by its own
    factor; the split over blocks keeps the op-class model's proportions. Unchanged otherwise."""
    timing = _timing(blocks, calibration)
    if timing is None:
        return fwd_s, bwd_s, overhead_s
    slow = device.slowdown

    def scaled(values: Times, measured_s: float) -> Times:
        total = sum(values)
        if total <= 0:                      # nothing to apportion by: spread evenly
            return tuple(measured_s * slow / len(values) for _ in values)
        return tuple(v * measured_s * slow / total for v in values)

    return (scaled(fwd_s, timing.fwd_s_per_sample), scaled(bwd_s, timing.bwd_s_per_sample),
            scaled(overhead_s, timing.fwd_s_per_micro_batch + timing.bwd_s_per_micro_batch))


def with_step_costs(optimizer_s: Times, blocks: list[Block], global_batch: int,
                    calibration: Calibration) -> Times:
    """Optimizer times per block plus, on the first block, what every rank does once per step besides
    its stage's per-tensor work: the update's fixed cost, and building the step's global batch
    (`batch(global_batch, step)`, when the calibration timed this model).

    The search charges a pipeline its slowest stage's optimizer time; every stage pays these costs
    alike, so charging them to one block (the first stage's) adds them once to that maximum, within
    the spread of the stages' optimizer times."""
    if not optimizer_s:
        return optimizer_s
    timing = _timing(blocks, calibration)
    step_s = calibration.optimizer_s_per_step + (timing.batch_s(global_batch) if timing else 0.0)
    return (optimizer_s[0] + step_s, *optimizer_s[1:])


def _timing(blocks: list[Block], calibration: Calibration) -> ModelTiming | None:
    return calibration.models.get(model_key(tuple(b.signature for b in blocks), tuple(b.fwd_flops for b in blocks)))
