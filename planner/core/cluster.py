"""The cluster's typed records: what a validated `spec.yaml` says, with units in every name.

`planner.frontend.cluster.load_cluster` builds them from a spec file; every layer after it works on
these frozen dataclasses and never reads YAML again.

Lost devices (`ClusterSpec.without`, for `plan replan`): the cluster less some devices keeps every
label (`group/node:local`): the program maps a label to a device by its local index, so losing
fast/0:0 must not make fast/0:1 another device. A node group whose nodes lost devices is split into
node groups of the nodes that kept the same devices (each node group stays uniform: every consumer of
`per_node`, the cost tables, the search, assembly, sees the real count of its nodes), each naming its
nodes (`NodeGroup.nodes`) and the local indices they kept (`NodeGroup.locals`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from planner.core.errors import OptionError

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
    mtbf_hours: float | None = None        # mean time between failures of one device (spec); None: unknown

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
    """`count` identical nodes, each with `per_node` devices joined by `intra_link`.

    `nodes` and `locals` are empty in a spec as written (its nodes numbered on from the groups before
    it, local indices 0..per_node-1); a cluster less lost devices names them: the cluster's node
    indices of this group's nodes, and the local indices each of them still has (len == per_node)."""

    name: str
    count: int
    device: DeviceType
    per_node: int
    intra_link: Link
    nodes: tuple[int, ...] = ()
    locals: tuple[int, ...] = ()


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
    """A validated cluster: node groups in spec order and the network between nodes.

    `lost`: labels of the spec's devices this cluster is without (`without`), sorted; its node groups
    then hold only the devices left."""

    name: str
    nodes: tuple[NodeGroup, ...]
    inter_node: Link
    source_path: str = ""
    device_types: Mapping[str, DeviceType] = field(default_factory=dict)
    storage_write_bytes_s: float | None = None    # per node, to checkpoint storage (spec `storage:`)
    lost: tuple[str, ...] = ()

    def devices(self) -> list[Device]:
        """Every device, in (node, local index) order; `index` is the position in this list (lost
        devices have none), `label` the spec's."""
        places = sorted((node, local, gi) for gi, node, locals_ in self._node_places() for local in locals_)
        return [Device(i, self.nodes[gi].name, node, local, self.nodes[gi].device)
                for i, (node, local, gi) in enumerate(places)]

    def _node_places(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(node group's position, node index, local indices) of every node, in group order."""
        out: list[tuple[int, int, tuple[int, ...]]] = []
        next_node = 0
        for gi, group in enumerate(self.nodes):
            nodes = group.nodes or tuple(range(next_node, next_node + group.count))
            locals_ = group.locals or tuple(range(group.per_node))
            out.extend((gi, node, locals_) for node in nodes)
            next_node = max(nodes, default=next_node - 1) + 1
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
        """The (first) node group called `name` (KeyError if there is none)."""
        for g in self.nodes:
            if g.name == name:
                return g
        raise KeyError(name)

    def without(self, labels: Iterable[str], flag: str = "--without") -> ClusterSpec:
        """This cluster less the devices labelled `labels` (see the module docstring); raises OptionError
        naming `flag` for a label it does not have, or when no device would be left."""
        labels = tuple(dict.fromkeys(labels))
        have = {d.label for d in self.devices()}
        unknown = [label for label in labels if label not in have]
        if unknown:
            known = sorted(have, key=_label_order)
            listed = ", ".join(known[:8]) + (f", ... ({len(known)} in all)" if len(known) > 8 else "")
            raise OptionError(f"the cluster has no device {unknown[0]!r}"
                              + (" (lost already)" if unknown[0] in self.lost else ""), field=flag,
                              fix=f"name devices as group/node:local, one of: {listed}")
        if not labels:
            return self
        gone = set(labels)
        if gone >= have:
            raise OptionError(f"that removes every device of the cluster ({len(have)})", field=flag,
                              fix="leave at least one device to plan on, or give a new spec with --cluster")
        kept: dict[tuple[int, tuple[int, ...]], list[int]] = {}   # (group position, locals kept) -> its nodes
        for gi, node, locals_ in self._node_places():
            left = tuple(local for local in locals_ if f"{self.nodes[gi].name}/{node}:{local}" not in gone)
            if left:
                kept.setdefault((gi, left), []).append(node)
        groups = tuple(replace(self.nodes[gi], count=len(nodes), per_node=len(left), nodes=tuple(nodes), locals=left)
                       for (gi, left), nodes in sorted(kept.items(), key=lambda item: item[1][0]))
        return replace(self, nodes=groups, lost=tuple(sorted(set(self.lost) | gone, key=_label_order)))


def parse_label(label: str) -> tuple[str, int, int]:
    """(group, node, local) of a device label `group/node:local` (Device.label; ValueError where it is not one)."""
    group, _, place = label.rpartition("/")
    node, _, local = place.partition(":")
    return group, int(node), int(local)


def _label_order(label: str) -> tuple[int, int, str]:
    """Labels `group/node:local` by node, then local index."""
    group, _, place = label.rpartition("/")
    node, _, local = place.partition(":")
    return (int(node), int(local), group) if node.isdigit() and local.isdigit() else (1 << 62, 0, label)
