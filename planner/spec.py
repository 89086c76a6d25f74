"""Typed cluster description: what `spec.yaml` says, validated, with units in every name.

`load_cluster(path)` is the only way in; everything after it works on these frozen
dataclasses and never reads YAML again. Device and link figures a spec names but does not
give come from the catalog in `costmodel/catalog/` (`load_catalog()`, `load_links()`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from planner.errors import SpecError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

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


# ---- loading: the YAML says TFLOP/s, GiB, GB/s, Gbit/s, us; the dataclasses FLOP/s, bytes, bytes/s, s
FLOP_S_PER_TFLOP_S = 1e12
BYTES_PER_GIB = 2**30
BYTES_S_PER_GBYTE_S = 1e9
BYTES_S_PER_GBIT_S = 1e9 / 8
US_PER_S = 1e6

NETWORK_KINDS = ("infiniband", "roce", "tcp", "loopback", "ethernet")
NO_LINK = "none"  # catalog link of a one-device node, and the network of a one-node cluster

_FIGURES = ("vendor", "peak_tflops", "memory_gib", "memory_bandwidth_gbyte_s")
_CATALOG_DEVICE_KEYS = (*_FIGURES, "tensor_cores", "price_per_hour", "source")
_CATALOG_LINK_KEYS = ("bandwidth_gbyte_s", "latency_us", "source")
_LINK_KEYS = ("kind", "bandwidth_gbyte_s", "latency_us")
_NETWORK_KEYS = ("kind", "bandwidth_gbit_s", "latency_us")
_NODE_KEYS = ("name", "count", "device", "per_node", "intra_link", "price_per_hour")
_NETWORK_EXAMPLE = "network: {inter_node: {kind: roce, bandwidth_gbit_s: 100, latency_us: 5}}"


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec; every problem raises a `SpecError` naming file, field and fix.

    A node group's `price_per_hour` is per device-hour and lands on that group's `device` only."""
    file = str(path)
    top = _Fields(file, _read_yaml(Path(path), file), "", ("name", "devices", "nodes", "network"),
                  ("nodes",), "the cluster spec")
    catalog, links = load_catalog(), load_links()
    known = {**catalog, **_declared_types(top, catalog)}
    groups = _node_groups(top, known, links)
    return ClusterSpec(top.text("name", Path(path).stem), groups, _inter_node(top, groups, links),
                       source_path=file, device_types={g.device.name: known[g.device.name] for g in groups})


def load_catalog(path: str | Path | None = None) -> dict[str, DeviceType]:
    """Device types by name, from `costmodel/catalog/devices.yaml` (or `path`)."""
    entries = _read_catalog(path, "devices.yaml")
    return {name: _device_type(name, entries.sub(name, _CATALOG_DEVICE_KEYS, (*_FIGURES, "source")), None, "")
            for name in entries.data}


def load_links(path: str | Path | None = None) -> dict[str, Link]:
    """Intra-node link kinds by name, from `costmodel/catalog/links.yaml` (or `path`)."""
    entries = _read_catalog(path, "links.yaml")
    links: dict[str, Link] = {}
    for kind in entries.data:
        fields = entries.sub(kind, _CATALOG_LINK_KEYS, _CATALOG_LINK_KEYS)
        fields.text("source")  # only checked: every figure says where it comes from
        links[kind] = Link(kind, fields.number("bandwidth_gbyte_s") * BYTES_S_PER_GBYTE_S,
                           fields.number("latency_us", positive=False) / US_PER_S)
    return links


def _read_catalog(path: str | Path | None, name: str) -> _Fields:
    source = Path(path) if path is not None else resources.files("costmodel") / "catalog" / name
    return _Fields(str(source), _read_yaml(source, str(source)), "", None, (), "entries by name")


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Safe loader (libyaml's if built) that rejects a key given twice in a mapping; PyYAML keeps the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        own = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]  # `<<:` may repeat keys
        keys = [self.construct_object(k, deep=deep) for k in own]
        for index, (k, key) in enumerate(zip(own, keys, strict=True)):
            if isinstance(key, str | int | float) and key in keys[:index]:  # report the repeat
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", k.start_mark)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path | Traversable, file: str) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _fail(file, "", "file not found", "check the path; a relative one starts at the working directory")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(file, "", f"cannot read the file ({exc})", "pass a readable UTF-8 YAML file")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        _fail(file, where, f"malformed YAML: {getattr(exc, 'problem', None) or exc}", "fix the YAML there")


def _declared_types(top: _Fields, catalog: Mapping[str, DeviceType]) -> dict[str, DeviceType]:
    """Types under `devices:`: full figures, or `base: CATALOG_NAME` plus overrides."""
    if "devices" not in top.data:
        return {}
    section = top.sub("devices", None, (), "device types by name")
    declared: dict[str, DeviceType] = {}
    for name, raw in section.data.items():
        derived = isinstance(raw, dict) and "base" in raw
        fields = section.sub(name, ("base", "slowdown", *_CATALOG_DEVICE_KEYS), () if derived else _FIGURES,
                             f"device type {name}")
        base = catalog[fields.choice("base", catalog, "catalog device")] if derived else None
        note = f"{'derived from ' + base.name if base else 'declared'} in {Path(top.file).name}"
        declared[name] = _device_type(name, fields, base, f"{base.source}; {note}" if base else note)
    return declared


def _device_type(name: str, fields: _Fields, base: DeviceType | None, source: str) -> DeviceType:
    """A DeviceType from `fields`; what `fields` lacks comes from `base`. Peaks merge per precision."""
    peaks = dict(base.peak_flops_s) if base else {}
    if "peak_tflops" in fields.data:
        table = fields.sub("peak_tflops", PRECISIONS, (), "peak TFLOP/s per precision")
        peaks.update({p: table.number(p) * FLOP_S_PER_TFLOP_S for p in table.data})
    if "fp32" not in peaks:
        fields.fail("peak_tflops.fp32", "missing the fp32 peak (others fall back to it)", "add `fp32: N`")
    memory_gib = fields.number("memory_gib", default=base.memory_bytes / BYTES_PER_GIB if base else None)
    bandwidth = fields.number("memory_bandwidth_gbyte_s",
                              default=base.memory_bandwidth_bytes_s / BYTES_S_PER_GBYTE_S if base else None)
    price = fields.number("price_per_hour", positive=False) if "price_per_hour" in fields.data else None
    return DeviceType(
        name=name, vendor=fields.text("vendor", base.vendor if base else None), peak_flops_s=peaks,
        memory_bytes=round(memory_gib * BYTES_PER_GIB),
        memory_bandwidth_bytes_s=bandwidth * BYTES_S_PER_GBYTE_S,
        tensor_cores=fields.flag("tensor_cores", base.tensor_cores if base else False),
        slowdown=fields.number("slowdown", default=1.0), base=base.name if base else None,
        source=fields.text("source", source or None),
        price_per_hour=price if price is not None or base is None else base.price_per_hour)


def _node_groups(top: _Fields, known: dict[str, DeviceType], links: dict[str, Link]) -> tuple[NodeGroup, ...]:
    raw_groups = top.data["nodes"]
    if not isinstance(raw_groups, list) or not raw_groups:
        got = "an empty list" if raw_groups == [] else _kind(raw_groups)
        top.fail("nodes", f"expected a non-empty list of node groups, got {got}",
                 "list at least one: - {name: a100, count: 1, device: A100-80GB, per_node: 8, ...}")
    groups: list[NodeGroup] = []
    for index, raw in enumerate(raw_groups):
        fields = _Fields(top.file, raw, f"nodes[{index}]", _NODE_KEYS, _NODE_KEYS[:4],
                         "a node group {name, count, device, per_node, intra_link}")
        name = fields.text("name")
        if name in (seen := [g.name for g in groups]):
            fields.fail("name", f"duplicate node group {name!r}, as nodes[{seen.index(name)}]",
                        "give each node group its own name")
        count, per_node = fields.integer("count"), fields.integer("per_node")
        device = known[fields.choice("device", known, "device", "; or declare it under `devices:`")]
        if "price_per_hour" in fields.data:
            device = replace(device, price_per_hour=fields.number("price_per_hour", positive=False))
        groups.append(NodeGroup(name, count, device, per_node, _intra_link(fields, per_node, links)))
    return tuple(groups)


def _intra_link(fields: _Fields, per_node: int, links: dict[str, Link]) -> Link:
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
        link = Link(spec.text("kind"), spec.number("bandwidth_gbyte_s") * BYTES_S_PER_GBYTE_S,
                    spec.number("latency_us", positive=False) / US_PER_S)
    if link.kind == NO_LINK and per_node > 1:
        fields.fail("intra_link", f"`{NO_LINK}` means no link, but per_node is {per_node}",
                    "name the link joining the devices of one node, e.g. nvlink3 or pcie4")
    return link


def _inter_node(top: _Fields, groups: tuple[NodeGroup, ...], links: dict[str, Link]) -> Link:
    total_nodes = sum(g.count for g in groups)
    if "network" not in top.data and total_nodes == 1:
        return links[NO_LINK]
    top.require(("network",), f"the cluster has {total_nodes} nodes", f"add `{_NETWORK_EXAMPLE}`")
    network = top.sub("network", ("inter_node",), ("inter_node",), "the network between nodes")
    link = network.sub("inter_node", _NETWORK_KEYS, _NETWORK_KEYS, "{kind, bandwidth_gbit_s, latency_us}")
    return Link(link.choice("kind", NETWORK_KINDS, "network kind"),
                link.number("bandwidth_gbit_s") * BYTES_S_PER_GBIT_S,
                link.number("latency_us", positive=False) / US_PER_S)


# ---- reading fields, with errors that name the file and the field path ------------------------------
def _fail(file: str, field_path: str, message: str, fix: str) -> NoReturn:
    raise SpecError(message, file=file, field=field_path or None, fix=fix)


def _kind(value: object) -> str:
    """A value's type in YAML words, for error messages."""
    words = {"NoneType": "nothing (null)", "bool": "a boolean", "int": "an integer", "float": "a number",
             "str": "a string", "list": "a list", "dict": "a mapping"}
    return words.get(type(value).__name__, type(value).__name__)


def _ranked(word: str, names: Iterable[str]) -> str:
    """`names` comma-separated, closest to `word` first: those containing it, then by difflib ratio."""
    wanted = word.lower()
    def distance(name: str) -> tuple[bool, float, str]:
        return wanted not in name.lower(), -difflib.SequenceMatcher(None, wanted, name.lower()).ratio(), name
    return ", ".join(sorted(set(names), key=distance))


class _Fields:
    """One YAML mapping at field path `path` of `file`: keys checked, values read with their types."""

    def __init__(self, file: str, data: object, path: str, allowed: tuple[str, ...] | None,
                 required: Iterable[str] = (), what: str = "a mapping") -> None:
        self.file, self.path = file, path
        if not isinstance(data, dict):
            empty = data is None and not path
            _fail(file, path, "the file is empty" if empty else f"expected {what}, got {_kind(data)}",
                  f"write {path or 'the file'} as {what}, in `key: value` form")
        self.data: dict[str, object] = data
        unknown = [str(key) for key in data
                   if not isinstance(key, str) or allowed is not None and key not in allowed]
        if unknown:  # a non-string key (`100:`) is never a valid name either
            self.fail(unknown[0], f"unknown key(s) {', '.join(unknown)}",
                      f"allowed keys here: {_ranked(unknown[0], allowed)}" if allowed else "quote the key")
        self.require(required)

    def at(self, key: str) -> str:
        """Field path of `key` inside this mapping."""
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str, fix: str) -> NoReturn:
        _fail(self.file, self.at(key), message, fix)

    def require(self, keys: Iterable[str], why: str = "", fix: str = "") -> None:
        """Fail on the first of `keys` that is missing; `why` says why it is needed here."""
        for key in keys:
            if key not in self.data:
                self.fail(key, "missing required field" + (f" ({why})" if why else ""),
                          fix or f"add `{key}:` to {self.path or 'the top level'}")

    def sub(self, key: str, allowed: tuple[str, ...] | None, required: Iterable[str] = (),
            what: str = "a mapping") -> _Fields:
        return _Fields(self.file, self.data.get(key), self.at(key), allowed, required, what)

    def _get(self, key: str, default: object, check: Callable[[object], bool], want: str, fix: str) -> Any:
        if default is None:
            self.require((key,))  # no default: the field is required
        value = self.data.get(key, default)
        if not check(value):
            self.fail(key, f"expected {want}, got {_kind(value)} {value!r}", fix)
        return value

    def text(self, key: str, default: str | None = None) -> str:
        return str(self._get(key, default, lambda v: isinstance(v, str) and bool(v.strip()),
                             "a non-empty string", "write a name (quote it if it looks like a number)"))

    def flag(self, key: str, default: bool) -> bool:
        return bool(self._get(key, default, lambda v: isinstance(v, bool), "true or false",
                              "write true or false, unquoted"))

    def number(self, key: str, *, positive: bool = True, default: float | None = None) -> float:
        """A finite number: > 0 when `positive`, else >= 0 (latencies, prices)."""
        value = float(self._get(key, default, lambda v: isinstance(v, int | float) and not isinstance(v, bool)
                                and math.isfinite(v), "a finite number", "write a plain number"))
        if value <= 0 if positive else value < 0:
            self.fail(key, f"must be {'> 0' if positive else '>= 0'}, got {value:g}",
                      f"give a {'positive' if positive else 'non-negative'} value")
        return value

    def choice(self, key: str, options: Iterable[str], what: str, also: str = "") -> str:
        """A string naming one of `options`; the fix lists them, closest to what was written first."""
        value = self.text(key)
        if value not in options:
            self.fail(key, f"unknown {what} {value!r}", f"use one of: {_ranked(value, options)}{also}")
        return value

    def integer(self, key: str) -> int:
        value = self._get(key, None, lambda v: isinstance(v, int) and not isinstance(v, bool),
                          "a whole number", "write e.g. 1, 2 or 8")
        if value <= 0:
            self.fail(key, f"must be >= 1, got {value}", "give a positive count")
        return int(value)
