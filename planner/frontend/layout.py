"""Read a layout the user wrote (`plan estimate --layout`): a YAML file, or the Megatron-style shorthand
`dp=4,tp=2,pp=2,mb=1` (`vpp=2`: interleaved), into typed records. Nothing here knows the model or the cluster: names of
node groups and device types, block and layer numbers are checked against them when the layout is
built into the search's records (planner.search.given).

The file (every field but `replicas` optional; examples/layouts/ has one):

    global_batch: 64               # else --global-batch
    compression: none              # gradient compressor of every group: none|auto|fp16|bf16|powersgd|onebit
    activation_compression: none   # on pipeline links: none|auto|fp16|bf16|int8
    zero: false                    # shard the optimizer state across replicas (ZeRO-1)
    replicas:
      - devices: fast              # a node group or device type of the spec; a list: one per stage;
                                   # or {group|type: NAME, count: N} (N = stages x tp)
        stages: 2                  # a count (equal blocks per stage), or a list of ranges:
                                   #   - {blocks: 0-5}   blocks 0..5 (as `plan inspect` numbers them)
                                   #   - {layers: 2-3}   the model's repeated layers 2..3
        tp: 1                      # tensor-parallel degree of every stage (one for all replicas)
        micro_batch: 4             # micro-batch size
        micro_batches: 4           # micro-batch count (share = size x count unless `share` says)
        share: 16                  # samples of the global batch (default: the batch split equally)
        schedule: 1f1b             # 1f1b | gpipe | interleaved | zbh1
        chunks: 1                  # stages per device (interleaved 1F1B: stage k on device k mod stages/chunks)
        compression: none          # as the top-level field (a gradient group spans the replicas: one for all)

With `chunks` above 1 the schedule is interleaved 1F1B and `devices` names (or counts, with tp) the
stages / chunks devices of the pipeline; the shorthand's `vpp=` (Megatron's virtual pipeline stages) is
the same: pp devices of pp x vpp stages.

Defaults: one stage; degree 1; 1F1B; no compression; shares the global batch split equally over the
replicas that give none; micro-batch count the stage count (the fewest that fill a 1F1B pipeline), so
the size is the share over it, rounded up.

A plan (`plan.json`, or its directory) is a layout too: `layout_of_plan` writes its layout in these
records, `to_yaml` as a file that reads back to the same records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from costmodel import compression
from planner.core import schedule as schedules
from planner.core.errors import OptionError
from planner.core.fields import Fields, echo, read_yaml, yaml_kind
from planner.core.ir import Plan

TP_DEGREES = (1, 2, 4, 8)
MAX_COUNT = 1 << 20          # replicas, stages, micro-batches, samples: beyond any cluster or batch
SHORTHAND_KEYS = ("dp", "tp", "pp", "mb", "vpp", "gbs")
_SHORTHAND = re.compile(r"^\s*[a-z]+\s*=\s*\d+\s*(,\s*[a-z]+\s*=\s*\d+\s*)*$")
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_TOP_KEYS = ("global_batch", "compression", "activation_compression", "zero", "precision", "memory_margin",
             "replicas")
_REPLICA_KEYS = ("devices", "stages", "tp", "micro_batch", "micro_batches", "share", "schedule", "chunks",
                 "compression")
_DEVICE_KEYS = ("group", "type", "count")
UNITS = ("blocks", "layers")


@dataclass(frozen=True)
class StageRange:
    """One stage: `first`..`last` (inclusive) of `unit` (blocks, or the model's repeated layers)."""

    unit: str
    first: int
    last: int


@dataclass(frozen=True)
class DeviceChoice:
    """Where a replica runs: per stage, a node group or device type name (`names`, one per stage, or one
    for all), or `count` devices of one (`count`: stages x tp; None where the names say it)."""

    names: tuple[str, ...] = ()        # empty: the shorthand's (the cluster's devices in order)
    count: int | None = None
    key: str = "group"                 # with `count`: which the name was given as (group or type)


@dataclass(frozen=True)
class ReplicaLayout:
    devices: DeviceChoice
    stages: int | None = None                    # a count of equal-block stages (None: from `ranges`)
    ranges: tuple[StageRange, ...] = ()
    tp: int = 1
    micro_batch: int | None = None
    micro_batches: int | None = None
    share: int | None = None
    schedule: str = "1f1b"
    compression: str | None = None
    where: str = ""                              # its field path, for errors: `replicas[0]`
    chunks: int = 1                              # stages per device (interleaved 1F1B)


@dataclass(frozen=True)
class Layout:
    """A whole layout: its replicas and the options that shape every replica's costs."""

    source: str                                  # the file, or `--layout` for the shorthand
    replicas: tuple[ReplicaLayout, ...] = ()
    global_batch: int | None = None
    compression: str | None = None
    activation_compression: str | None = None
    zero: bool = False
    precision: str | None = None
    memory_margin: float | None = None
    shorthand: Shorthand | None = None


@dataclass(frozen=True)
class Shorthand:
    """`dp=,tp=,pp=,mb=` (and `gbs=`): dp replicas of pp stages of tp devices, equal blocks per stage,
    micro-batch size mb; placed on the cluster by planner.search.given (fastest device class first)."""

    dp: int
    tp: int
    pp: int
    mb: int
    gbs: int | None = None
    text: str = field(default="", compare=False)
    vpp: int = 1                  # stages per device (interleaved 1F1B): pp devices of pp x vpp stages


def is_shorthand(text: str) -> bool:
    """Whether `--layout TEXT` is the shorthand (`key=value,...`) rather than a file name."""
    return "=" in text and not Path(text).exists()


def load_layout(text: str) -> Layout:
    """The layout `--layout TEXT` names: the shorthand, a plan (plan.json or its directory), or a layout
    file; raises OptionError / SpecError / PlanFileError (one line: file, field, fix)."""
    if not text.strip():       # Path("") is the working directory: it would be read as a plan there
        raise OptionError("empty: it names no layout", field="--layout",
                          fix="name a layout file or a plan (out/), or give dp=,tp=,pp=,mb=")
    if is_shorthand(text):
        return Layout(f"--layout {text.strip()}", shorthand=parse_shorthand(text))
    path = Path(text)
    if path.is_dir() or path.suffix == ".json":
        return layout_of_plan(Plan.load(path), str(path))
    return parse_layout(read_yaml(path, text), text)


def parse_shorthand(text: str) -> Shorthand:
    flag = "--layout"
    if not _SHORTHAND.match(text):
        raise OptionError(f"malformed layout shorthand {echo(text)}", field=flag,
                          fix="write key=value pairs joined by commas, e.g. dp=4,tp=2,pp=2,mb=1, or name a file")
    values: dict[str, int] = {}
    for part in text.split(","):
        key, _, value = (p.strip() for p in part.partition("="))
        if key not in SHORTHAND_KEYS:
            raise OptionError(f"unknown shorthand key {echo(key)}", field=f"{flag} {key}",
                              fix=f"use {', '.join(SHORTHAND_KEYS)} (gbs optional)")
        if key in values:
            raise OptionError(f"{key} given twice", field=f"{flag} {key}", fix="give each key once")
        number = int(value)
        if not 1 <= number <= MAX_COUNT:
            raise OptionError(f"{key}={number} must be from 1 to {MAX_COUNT}", field=f"{flag} {key}",
                              fix=f"give a positive whole number, e.g. {key}=2")
        values[key] = number
    missing = [k for k in ("dp", "tp", "pp", "mb") if k not in values]
    if missing:
        completed = ",".join([text.strip(), *(f"{k}=1" for k in missing)])
        raise OptionError(f"the shorthand lacks {', '.join(missing)}", field=f"{flag} {missing[0]}",
                          fix=f"give dp, tp, pp and mb, e.g. {echo(completed)}")
    if values["tp"] not in TP_DEGREES:
        raise OptionError(f"tp={values['tp']} is not a tensor-parallel degree", field=f"{flag} tp",
                          fix="give tp=1, 2, 4 or 8")
    return Shorthand(values["dp"], values["tp"], values["pp"], values["mb"], values.get("gbs"), text,
                     values.get("vpp", 1))


def parse_layout(data: object, file: str) -> Layout:
    """A layout file's data (read by planner.core.fields.read_yaml) as a Layout; SpecError on the first
    field that is wrong, naming the file and the field path."""
    top = Fields(file, data, "", _TOP_KEYS, ("replicas",), "a layout {replicas: [...]}")
    replicas = top.data["replicas"]
    if not isinstance(replicas, list) or not replicas:
        top.fail("replicas", f"expected a non-empty list, got {yaml_kind(replicas)}",
                 "list the replicas: replicas: [{devices: fast, stages: 2}]")
    if len(replicas) > MAX_COUNT:
        top.fail("replicas", f"{len(replicas)} replicas", f"give at most {MAX_COUNT}")
    grad = _optional_choice(top, "compression", compression.GRADIENT_POLICIES, "gradient compression")
    parsed = tuple(_replica(Fields(file, r, f"replicas[{i}]", _REPLICA_KEYS, (), "a replica {devices, stages}"))
                   for i, r in enumerate(replicas))
    own = {r.compression for r in parsed if r.compression is not None} | ({grad} if grad else set())
    if len(own) > 1:
        first = next(r for r in parsed if r.compression is not None)
        fail_at = Fields(file, replicas[parsed.index(first)], first.where, None)
        fail_at.fail("compression", f"compressors {', '.join(sorted(own))} differ between replicas",
                     "give one: a gradient group spans every replica holding its parameters")
    margin = top.number("memory_margin", positive=False, default=-1.0) if "memory_margin" in top.data else None
    if margin is not None and not margin < 1:
        top.fail("memory_margin", f"must be below 1, got {margin:g}", "give the fraction kept free, e.g. 0.1")
    return Layout(
        source=file, replicas=parsed,
        global_batch=top.integer("global_batch", MAX_COUNT) if "global_batch" in top.data else None,
        compression=next(iter(own)) if own else None,
        activation_compression=_optional_choice(top, "activation_compression", compression.ACTIVATION_POLICIES,
                                                "activation compression"),
        zero=top.flag("zero", False),
        precision=_optional_choice(top, "precision", ("auto", "fp32", "bf16", "fp16"), "precision policy"),
        memory_margin=margin)


def _optional_choice(fields: Fields, key: str, options: tuple[str, ...], what: str) -> str | None:
    return fields.choice(key, options, what) if key in fields.data else None


def _count(fields: Fields, key: str) -> int | None:
    return fields.integer(key, MAX_COUNT) if key in fields.data else None


def _replica(f: Fields) -> ReplicaLayout:
    tp = f.integer("tp", 8) if "tp" in f.data else 1
    if tp not in TP_DEGREES:
        f.fail("tp", f"degree {tp} is not 1, 2, 4 or 8", "give a divisor of the devices per node: 1, 2, 4 or 8")
    stages: int | None = None
    ranges: tuple[StageRange, ...] = ()
    raw = f.data.get("stages", 1)
    if isinstance(raw, list):
        if not raw:
            f.fail("stages", "an empty list", "give a stage count, or one range per stage")
        ranges = tuple(_stage_range(f, i, item) for i, item in enumerate(raw))
    elif "stages" in f.data:
        stages = f.integer("stages", MAX_COUNT)
    devices = _devices(f)
    chunks = f.integer("chunks", MAX_COUNT) if "chunks" in f.data else 1
    schedule = f.choice("schedule", schedules.SCHEDULES, "schedule") if "schedule" in f.data else \
        ("interleaved" if chunks > 1 else "1f1b")
    if (chunks > 1) != (schedule == "interleaved"):
        f.fail("chunks" if chunks > 1 else "schedule", f"schedule {schedule} with {chunks} stage(s) per device",
               "give schedule: interleaved with chunks of 2 or more, or leave chunks at 1")
    count = len(ranges) or stages
    if count is not None and count % chunks:
        f.fail("chunks", f"{count} stage(s) are not whole groups of chunks={chunks}",
               "give a stage count that is a multiple of chunks")
    if devices.count is not None:
        if devices.count % tp:
            f.fail("devices.count", f"{devices.count} devices are not whole groups of tp={tp}",
                   "give stages / chunks x tp devices")
        if "stages" not in f.data:
            stages, count = devices.count // tp * chunks, devices.count // tp * chunks
        elif count is not None and count // chunks * tp != devices.count:
            f.fail("devices.count", f"{devices.count} devices for {count} stage(s) of tp={tp}, {chunks} per device",
                   f"give count: {count // chunks * tp}, or drop it")
    elif len(devices.names) > 1:
        if "stages" not in f.data:
            stages, count = len(devices.names) * chunks, len(devices.names) * chunks
        elif count is not None and count // chunks != len(devices.names):
            f.fail("devices", f"{len(devices.names)} names for {count} stage(s), {chunks} per device",
                   "name one node group or device type per device, or one for all")
    return ReplicaLayout(
        devices=devices, stages=stages if not ranges else None, ranges=ranges, tp=tp,
        micro_batch=_count(f, "micro_batch"), micro_batches=_count(f, "micro_batches"), share=_count(f, "share"),
        schedule=schedule,
        compression=_optional_choice(f, "compression", compression.GRADIENT_POLICIES, "gradient compression"),
        where=f.path, chunks=chunks)


def _devices(f: Fields) -> DeviceChoice:
    raw = f.data.get("devices")
    if raw is None:
        f.fail("devices", "missing required field", "name a node group or device type of the spec: devices: fast")
    if isinstance(raw, str):
        return DeviceChoice((f.text("devices"),))
    if isinstance(raw, list) and raw and all(isinstance(x, str) and x for x in raw):
        return DeviceChoice(tuple(raw))
    if isinstance(raw, dict):
        sub = f.sub("devices", _DEVICE_KEYS, ("count",), "{group|type: NAME, count: N}")
        kinds = [k for k in ("group", "type") if k in sub.data]
        if len(kinds) != 1:
            sub.fail("group", "give exactly one of group, type", "e.g. devices: {type: A100, count: 4}")
        return DeviceChoice((sub.text(kinds[0]),), sub.integer("count", MAX_COUNT), kinds[0])
    f.fail("devices", f"expected a name, a list of names or a mapping, got {yaml_kind(raw)} {echo(raw)}",
           "e.g. devices: fast, devices: [fast, slow], or devices: {type: A100, count: 4}")


def _stage_range(f: Fields, i: int, item: object) -> StageRange:
    where = f"stages[{i}]"
    sub = Fields(f.file, item, f.at(where), UNITS, (), "a range {blocks: 0-5} or {layers: 0-1}")
    if len(sub.data) != 1:
        sub.fail("blocks", "give exactly one of blocks, layers", "e.g. - {blocks: 0-5}")
    unit, value = next(iter(sub.data.items()))
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in value):
        text = f"{value[0]}-{value[1]}"
    match = _RANGE.match(text) if isinstance(text, str) else None
    if match is None:
        sub.fail(unit, f"expected a range FIRST-LAST, got {yaml_kind(value)} {echo(value)}",
                 f"write e.g. {unit}: 0-5 (inclusive), or {unit}: 3 for one")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
        sub.fail(unit, f"range {first}-{last} ends before it starts", f"write {last}-{first}")
    return StageRange(unit, first, last)


def layout_of_plan(plan: Plan, source: str = "plan.json") -> Layout:
    """A plan's own layout: per replica its stages' node groups and block ranges, degree, micro-batches,
    share and schedule; the options that shape its costs (global batch, compression, ZeRO, precision,
    memory margin) from the plan's inputs."""
    options = dict(plan.inputs.options)
    replicas = []
    for i, r in enumerate(plan.replicas):
        groups = tuple(st.device_label.rpartition("/")[0] for st in r.device_stages)
        replicas.append(ReplicaLayout(
            devices=DeviceChoice(groups if len(set(groups)) > 1 else groups[:1]), stages=None,
            ranges=tuple(StageRange("blocks", st.first_block, st.last_block) for st in r.stages),
            tp=r.tp_degree, micro_batch=r.micro_batch_sizes[0], micro_batches=len(r.micro_batch_sizes),
            share=r.batch_share, schedule=r.schedule, where=f"replicas[{i}]", chunks=r.chunks))
    return Layout(source=source, replicas=tuple(replicas), global_batch=plan.global_batch,
                  compression=options.get("compression", "none"),
                  activation_compression=options.get("activation_compression", "none"),
                  zero=any(g.zero for g in plan.grad_groups), precision=options.get("precision"),
                  memory_margin=plan.estimates.memory_margin)


def to_yaml(layout: Layout) -> str:
    """The layout file of `layout` (a file's or a plan's; not the shorthand's): reads back to equal records."""
    top: dict[str, Any] = {}
    for key in ("global_batch", "compression", "activation_compression", "precision", "memory_margin"):
        if getattr(layout, key) is not None:
            top[key] = getattr(layout, key)
    top["zero"] = layout.zero
    top["replicas"] = [_replica_data(r) for r in layout.replicas]
    return yaml.safe_dump(top, sort_keys=False, default_flow_style=None)


def _replica_data(r: ReplicaLayout) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = list(r.devices.names)
    if r.devices.count is not None:
        out["devices"] = {r.devices.key: names[0], "count": r.devices.count}
    else:
        out["devices"] = names[0] if len(names) == 1 else names
    out["stages"] = [{x.unit: f"{x.first}-{x.last}"} for x in r.ranges] if r.ranges else (r.stages or 1)
    out["tp"] = r.tp
    for key in ("micro_batch", "micro_batches", "share"):
        if getattr(r, key) is not None:
            out[key] = getattr(r, key)
    out["schedule"] = r.schedule
    if r.chunks > 1:
        out["chunks"] = r.chunks
    if r.compression is not None:
        out["compression"] = r.compression
    return out
