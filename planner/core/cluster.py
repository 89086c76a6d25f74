"""The cluster's typed records: what a validated `spec.yaml` says, with units in every name.

`planner.frontend.cluster.load_cluster` builds them from a spec file; every layer after it works on
these frozen dataclasses and never reads YAML again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")


@dataclass(frozen=True)
class DeviceType:
    """One accelerator (or CPU) type: datasheet figures, with where they came from."""

    name: str
    vendor: str
    peak_flops_s: Mapping[str, float]      # precision -> FLOP/s (dense), e.g. {"fp32": 19.5e12}
    memory_bytes: int
    memory_bandwidth_bytes_s: float
    tensor_cores: bool = False
    slowdown: float = 1.0                  # emulation factor: each compute step padded to slowdown x
    base: str | None = None                # catalog type this one derives from (spec `base:`)
    source: str = ""                       # datasheet / measurement the figures come from
    price_per_hour: float | None = None

    def peak(self, precision: str) -> float:
        """Peak FLOP/s at `precision`, falling back to fp32 where the type lacks it."""
        return float(self.peak_flops_s.get(precision) or self.peak_flops_s["fp32"])

    def supports(self, precision: str) -> bool:
        """Whether the datasheet gives a peak for `precision` (bf16 on V100: no)."""
        return bool(self.peak_flops_s.get(precision))


@dataclass(frozen=True)
class Link:
    """A link class: alpha-beta model (latency + bytes / bandwidth)."""

    kind: str
    bandwidth_bytes_s: float
    latency_s: float

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move `nbytes` one way over this link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class NodeGroup:
    """`count` identical nodes, each with `per_node` devices joined by `intra_link`."""

    name: str
    count: int
    device: DeviceType
    per_node: int
    intra_link: Link


@dataclass(frozen=True)
class Device:
    """One physical device, with its place in the topology."""

    index: int            # global index in spec order (node group, node, local)
    group: str            # node group name
    node: int             # node index within the whole cluster
    local: int            # index within its node
    type: DeviceType

    @property
    def label(self) -> str:
        return f"{self.group}/{self.node}:{self.local}"


@dataclass(frozen=True)
class ClusterSpec:
    """A validated cluster: node groups in spec order and the network between nodes."""

    name: str
    nodes: tuple[NodeGroup, ...]
    inter_node: Link
    source_path: str = ""
    device_types: Mapping[str, DeviceType] = field(default_factory=dict)

    def devices(self) -> list[Device]:
        """Every device, in spec order (node group, node, local index)."""
        out: list[Device] = []
        node_index = 0
        for group in self.nodes:
            for _ in range(group.count):
                for local in range(group.per_node):
                    out.append(Device(len(out), group.name, node_index, local, group.device))
                node_index += 1
        return out

    @property
    def num_devices(self) -> int:
        return sum(g.count * g.per_node for g in self.nodes)

    def link_between(self, a: Device, b: Device) -> Link:
        """The link two devices talk over: intra-node link of their group, else the network."""
        if a.node == b.node:
            return self.group(a.group).intra_link
        return self.inter_node

    def group(self, name: str) -> NodeGroup:
        """The node group called `name` (KeyError if there is none)."""
        for g in self.nodes:
            if g.name == name:
                return g
        raise KeyError(name)
