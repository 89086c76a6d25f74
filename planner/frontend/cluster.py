"""Load a cluster spec (`spec.yaml`) into the typed records of planner.core.cluster.

`load_cluster(path)` is the only way in. Device and link figures a spec names but does not give come
from the catalog (costmodel.catalog). Names are checked at this edge: node-group, device-type and link
names are safe names (planner.core.fields.NAME_PATTERN: they become device labels `group/node:local`,
launch.sh comments, logs and report cells), the cluster's `name` is one line of printable text, and
a spec describes at most MAX_DEVICES devices.

Reliability and storage, for the checkpoint interval (costmodel.checkpoint): a device type (under
`devices:`) or a node group may give `mtbf_hours`, one device's mean time between failures in hours;
`storage: {write_gbyte_s: X}` is the write bandwidth per node to checkpoint storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from costmodel.catalog import DEVICE_KEYS, FIGURES, NO_LINK, device_type, load_catalog, load_links
from planner.core.cluster import ClusterSpec, DeviceType, Link, NodeGroup
from planner.core.fields import MAX_TEXT_CHARS, Fields, check_name, read_yaml, yaml_kind
from planner.core.units import BYTES_S_PER_GBIT_S, BYTES_S_PER_GBYTE_S, US_PER_S

NETWORK_KINDS = ("infiniband", "roce", "tcp", "loopback", "ethernet")
MAX_DEVICES = 100_000           # count x per_node summed over node groups: checked before anything is built
MAX_NAME_CHARS = 120            # the cluster's `name`, free text

_LINK_KEYS = ("kind", "bandwidth_gbyte_s", "latency_us")
_NETWORK_KEYS = ("kind", "bandwidth_gbit_s", "latency_us")
_NODE_KEYS = ("name", "count", "device", "per_node", "intra_link", "price_per_hour", "mtbf_hours")
_STORAGE_KEYS = ("write_gbyte_s",)
_NETWORK_EXAMPLE = "network: {inter_node: {kind: roce, bandwidth_gbit_s: 100, latency_us: 5}}"


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec; every problem raises a `SpecError` naming file, field and fix.

    A node group's `price_per_hour` is per device-hour and lands on that group's `device` only."""
    file = str(path)
    top = Fields(file, read_yaml(Path(path), file), "", ("name", "devices", "nodes", "network", "storage"),
                  ("nodes",), "the cluster spec")
    name = top.text("name", Path(path).stem[:MAX_TEXT_CHARS], max_chars=MAX_NAME_CHARS)
    catalog, links = load_catalog(), load_links()
    known = {**catalog, **_declared_types(top, catalog)}
    groups = _node_groups(top, known, links)
    return ClusterSpec(name, groups, _inter_node(top, groups, links),
                       source_path=file, device_types={g.device.name: known[g.device.name] for g in groups},
                       storage_write_bytes_s=_storage_write_bytes_s(top))


def _storage_write_bytes_s(top: Fields) -> float | None:
    """`storage: {write_gbyte_s: X}`: each node's write bandwidth to checkpoint storage (None: not given)."""
    if "storage" not in top.data:
        return None
    storage = top.sub("storage", _STORAGE_KEYS, _STORAGE_KEYS, "checkpoint storage {write_gbyte_s}")
    return storage.number("write_gbyte_s") * BYTES_S_PER_GBYTE_S


def _with_mtbf(device: DeviceType, fields: Fields) -> DeviceType:
    """`device` with the `mtbf_hours` that `fields` give (a positive number of hours), if they give one."""
    if "mtbf_hours" not in fields.data:
        return device
    return replace(device, mtbf_hours=fields.number("mtbf_hours"))


def _declared_types(top: Fields, catalog: Mapping[str, DeviceType]) -> dict[str, DeviceType]:
    """Types under `devices:`: full figures, or `base: CATALOG_NAME` plus overrides."""
    if "devices" not in top.data:
        return {}
    section = top.sub("devices", None, (), "device types by name")
    declared: dict[str, DeviceType] = {}
    for name, raw in section.data.items():
        check_name(name, "device type", top.file, section.at(name))
        derived = isinstance(raw, dict) and "base" in raw
        fields = section.sub(name, ("base", "slowdown", "mtbf_hours", *DEVICE_KEYS), () if derived else FIGURES,
                             f"device type {name}")
        base = catalog[fields.choice("base", catalog, "catalog device")] if derived else None
        note = f"{'derived from ' + base.name if base else 'declared'} in {Path(top.file).name}"
        declared[name] = _with_mtbf(device_type(name, fields, base, f"{base.source}; {note}" if base else note),
                                    fields)
    return declared


def _node_groups(top: Fields, known: dict[str, DeviceType], links: dict[str, Link]) -> tuple[NodeGroup, ...]:
    raw_groups = top.data["nodes"]
    if not isinstance(raw_groups, list) or not raw_groups:
        got = "an empty list" if raw_groups == [] else yaml_kind(raw_groups)
        top.fail("nodes", f"expected a non-empty list of node groups, got {got}",
                 "list at least one: - {name: a100, count: 1, device: A100-80GB, per_node: 8, ...}")
    groups: list[NodeGroup] = []
    seen: dict[str, int] = {}
    devices = 0
    for index, raw in enumerate(raw_groups):
        fields = Fields(top.file, raw, f"nodes[{index}]", _NODE_KEYS, _NODE_KEYS[:4],
                         "a node group {name, count, device, per_node, intra_link}")
        name = fields.name("name", "node group name")
        if name in seen:
            fields.fail("name", f"duplicate node group {name!r}, as nodes[{seen[name]}]",
                        "give each node group its own name")
        seen[name] = index
        count, per_node = fields.integer("count", MAX_DEVICES), fields.integer("per_node", MAX_DEVICES)
        devices += count * per_node
        if devices > MAX_DEVICES:
            fields.fail("count", f"the cluster has more than {MAX_DEVICES} devices (count x per_node, summed "
                        f"over node groups, reaches {devices} here)", f"describe at most {MAX_DEVICES} devices")
        device = known[fields.choice("device", known, "device", "; or declare it under `devices:`")]
        if "price_per_hour" in fields.data:
            device = replace(device, price_per_hour=fields.number("price_per_hour", positive=False))
        device = _with_mtbf(device, fields)
        groups.append(NodeGroup(name, count, device, per_node, _intra_link(fields, per_node, links)))
    return tuple(groups)


def _intra_link(fields: Fields, per_node: int, links: dict[str, Link]) -> Link:
    """`intra_link:` as a catalog link name or `{kind, bandwidth_gbyte_s, latency_us}`."""
    if "intra_link" not in fields.data and per_node == 1:
        return links[NO_LINK]
    fields.require(("intra_link",), f"per_node is {per_node}")
    raw = fields.data["intra_link"]
    if isinstance(raw, str):
        link = links[fields.choice("intra_link", links, "link kind",
                                   f"; or give {{{', '.join(_LINK_KEYS)}}}")]
    else:
        spec = fields.sub("intra_link", _LINK_KEYS, _LINK_KEYS,
                          f"a catalog link ({', '.join(links)}) or {{{', '.join(_LINK_KEYS)}}}")
        link = Link(spec.name("kind", "link kind"), spec.number("bandwidth_gbyte_s") * BYTES_S_PER_GBYTE_S,
                    spec.number("latency_us", positive=False) / US_PER_S)
    if link.kind == NO_LINK and per_node > 1:
        fields.fail("intra_link", f"`{NO_LINK}` means no link, but per_node is {per_node}",
                    "name the link joining the devices of one node, e.g. nvlink3 or pcie4")
    return link


def _inter_node(top: Fields, groups: tuple[NodeGroup, ...], links: dict[str, Link]) -> Link:
    total_nodes = sum(g.count for g in groups)
    if "network" not in top.data and total_nodes == 1:
        return links[NO_LINK]
    top.require(("network",), f"the cluster has {total_nodes} nodes", f"add `{_NETWORK_EXAMPLE}`")
    network = top.sub("network", ("inter_node",), ("inter_node",), "the network between nodes")
    link = network.sub("inter_node", _NETWORK_KEYS, _NETWORK_KEYS, "{kind, bandwidth_gbit_s, latency_us}")
    return Link(link.choice("kind", NETWORK_KINDS, "network kind"),
                link.number("bandwidth_gbit_s") * BYTES_S_PER_GBIT_S,
                link.number("latency_us", positive=False) / US_PER_S)
