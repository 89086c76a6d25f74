"""The device and link catalog: datasheet figures by name (`devices.yaml`, `links.yaml` beside this file).

A cluster spec names catalog entries, or declares its own types from them (`base:`); every figure
says where it comes from (`source`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from planner.core.cluster import PRECISIONS, DeviceType, Link
from planner.core.fields import Fields, check_name, read_yaml
from planner.core.units import BYTES_PER_GIB, BYTES_S_PER_GBYTE_S, FLOP_S_PER_TFLOP_S, US_PER_S

NO_LINK = "none"  # catalog link of a one-device node, and the network of a one-node cluster

FIGURES = ("vendor", "peak_tflops", "memory_gib", "memory_bandwidth_gbyte_s")
DEVICE_KEYS = (*FIGURES, "tensor_cores", "price_per_hour", "source")
_LINK_KEYS = ("bandwidth_gbyte_s", "latency_us", "source")


def load_catalog(path: str | Path | None = None) -> dict[str, DeviceType]:
    """Device types by name, from `costmodel/catalog/devices.yaml` (or `path`)."""
    entries = _read_catalog(path, "devices.yaml")
    for name in entries.data:
        check_name(name, "device type", entries.file, name)
    return {name: device_type(name, entries.sub(name, DEVICE_KEYS, (*FIGURES, "source")), None, "")
            for name in entries.data}


def load_links(path: str | Path | None = None) -> dict[str, Link]:
    """Intra-node link kinds by name, from `costmodel/catalog/links.yaml` (or `path`)."""
    entries = _read_catalog(path, "links.yaml")
    links: dict[str, Link] = {}
    for kind in entries.data:
        check_name(kind, "link kind", entries.file, kind)
        fields = entries.sub(kind, _LINK_KEYS, _LINK_KEYS)
        fields.text("source")  # only checked: every figure says where it comes from
        links[kind] = Link(kind, fields.number("bandwidth_gbyte_s") * BYTES_S_PER_GBYTE_S,
                           fields.number("latency_us", positive=False) / US_PER_S)
    return links


def _read_catalog(path: str | Path | None, name: str) -> Fields:
    source = Path(path) if path is not None else resources.files("costmodel.catalog") / name
    return Fields(str(source), read_yaml(source, str(source)), "", None, (), "entries by name")


def device_type(name: str, fields: Fields, base: DeviceType | None, source: str) -> DeviceType:
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
