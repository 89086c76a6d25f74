"""Say when a plan's estimates rest on placeholder figures: a device type costed from a catalog entry that
is no datasheet (the generic `CPU`: `source` starting with "placeholder", costmodel/catalog/devices.yaml)
and not calibrated. Such estimates were measured 37-120x below the real step on CPU; a plan that prints
them must say so, and how to replace them (`plan profile`, then `plan --calibration FILE`).

A derived type (`{base: CPU, slowdown: 3}`) keeps its base's placeholder figures unless the spec gives
its own peak or bandwidth; then the figures are the user's and no note is made.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from costmodel.calibration import Calibration
from planner.core.cluster import ClusterSpec, DeviceType
from planner.core.ir import Plan

PLACEHOLDER_SOURCE = "placeholder"       # how the catalog marks such an entry: its `source` starts with it
NOTE_PREFIX = "placeholder figures:"     # every note starts with it (backends.report.text finds them by it)
_NOTED_TYPE = re.compile(re.escape(NOTE_PREFIX) + r" device type (\S+) is costed")


def placeholder_entry(device: DeviceType, catalog: Mapping[str, DeviceType]) -> DeviceType | None:
    """The placeholder catalog entry whose figures `device` is costed with, or None (a datasheet entry,
    or figures the spec gave)."""
    entry = catalog.get(device.base or device.name)
    if entry is None or not entry.source.lower().startswith(PLACEHOLDER_SOURCE):
        return None
    same = (dict(device.peak_flops_s) == dict(entry.peak_flops_s)
            and device.memory_bandwidth_bytes_s == entry.memory_bandwidth_bytes_s)
    return entry if same else None


def placeholder_notes(plan: Plan, spec: ClusterSpec, calibration: Calibration | None,
                      catalog: Mapping[str, DeviceType] | None = None) -> tuple[str, ...]:
    """One warning per device type the plan runs on that is costed from placeholder figures without a
    calibration of it: the type, the entry, and the fix."""
    if catalog is None:
        from costmodel.catalog import load_catalog

        catalog = load_catalog()
    used = {stage.device_type for replica in plan.replicas for stage in replica.stages}
    notes = []
    for device in {g.device.name: g.device for g in spec.nodes if g.device.name in used}.values():
        entry = placeholder_entry(device, catalog)
        if entry is None or (calibration is not None and calibration.matches(device)):
            continue
        notes.append(f"{NOTE_PREFIX} device type {device.name} is costed from the catalog's placeholder "
                     f"{entry.name} entry, not a measurement, so its estimates may be many times too fast: run "
                     f"`plan profile --out calibration.json` on that machine and plan with "
                     f"`--calibration calibration.json`")
    return tuple(notes)


def noted_device_type(warning: str) -> str | None:
    """The device type a `placeholder_notes` line names, or None for any other warning."""
    found = _NOTED_TYPE.match(warning)
    return found.group(1) if found else None
