"""The plan: the typed, versioned IR between the search and the lowering passes.

Frozen dataclasses serialised to JSON with `schema_version`. A plan file alone is enough to
inspect, simulate, diff and emit. Same inputs give a byte-identical file: nothing here depends on
wall-clock time (solver timings live in `solve.json` beside it).

Fields added after a schema's first release are marked `OPTIONAL`: written only when they differ from
their default, so a plan that uses none of them reads byte for byte as before, and a file without
them loads with the default.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.core.errors import PlanFileError

SCHEMA_VERSION = 1
OPTIONAL = {"omit_default": True}    # field metadata: left out of the file at its default


@dataclass(frozen=True)
class BlockInfo:
    index: int
    first_node: str
    last_node: str
    label: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: float
    activation_bytes: float
    boundary_bytes: float
    signature: str


@dataclass(frozen=True)
class StagePlan:
    index: int                    # position in its pipeline
    first_block: int
    last_block: int
    last_node: str                # the stage ends after this compute node
    rank: int
    device: int                   # index into the cluster's device list
    device_label: str
    device_type: str
    precision: str
    recompute: bool
    fwd_s_per_sample: float
    bwd_s_per_sample: float
    overhead_s: float             # per micro-batch
    memory_bytes: float           # estimated peak
    params: tuple[str, ...]
    slowdown: float = 1.0         # emulation: pad each compute step to this multiple (spec `slowdown`)


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    node_group: str
    stages: tuple[StagePlan, ...]
    batch_share: int
    micro_batch_sizes: tuple[int, ...]
    schedule: str                 # "1f1b" | "gpipe"
    estimated_s: float

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.stages)


@dataclass(frozen=True)
class GradGroup:
    index: int
    ranks: tuple[int, ...]
    params: tuple[str, ...]
    nbytes: float
    compressor: str
    algorithm: str
    estimated_s: float


@dataclass(frozen=True)
class P2PEdge:
    replica: int
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    bytes_per_sample: float
    compressor: str


@dataclass(frozen=True)
class Estimates:
    iteration_s: float
    throughput_samples_s: float
    pipeline_s: float
    sync_s: float
    bubble_fraction: float
    memory_bytes: tuple[float, ...]      # per rank
    capacity_bytes: tuple[float, ...]    # per rank
    busy_s: tuple[float, ...]            # per rank
    cost_per_sample: float | None = None


@dataclass(frozen=True)
class RunnerUp:
    """Another plan the search considered, under the same cost model and simulator."""

    name: str                     # `ilp one-node`, a baseline strategy, ...
    estimated_iteration_s: float
    simulated_iteration_s: float
    pipeline_s: float
    sync_s: float
    devices_used: int
    layout: str                   # replicas as `group:stages x count`
    why_slower: str               # against the chosen plan, in words


@dataclass(frozen=True)
class SolverFacts:
    strategy: str
    status: str
    objective_s: float
    bound_s: float
    gap: float
    configurations: int
    runners_up: tuple[RunnerUp, ...] = ()
    simulated_iteration_s: float | None = None   # the chosen plan under backends.sim


@dataclass(frozen=True)
class PlanInputs:
    model_path: str
    model_digest: str
    cluster_path: str
    cluster_digest: str
    cluster_name: str
    options: tuple[tuple[str, str], ...]
    trace_batch: int
    model_input_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProgramDefaults:
    """The emitted program's defaults, from `plan`'s options; `plan run` / train.py flags override them."""

    learning_rate: float
    optimizer: str                                  # adamw | sgd
    functions: tuple[tuple[str, str], ...] = ()     # contract name -> the model file's name, where renamed


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    global_batch: int
    world_size: int
    blocks: tuple[BlockInfo, ...]
    replicas: tuple[ReplicaPlan, ...]
    grad_groups: tuple[GradGroup, ...]
    p2p: tuple[P2PEdge, ...]
    estimates: Estimates
    solver: SolverFacts
    schema_version: int = SCHEMA_VERSION
    devices: tuple[str, ...] = field(default=())   # per rank: device label
    program: ProgramDefaults | None = field(default=None, metadata=OPTIONAL)

    def stage_of_rank(self, rank: int) -> tuple[ReplicaPlan, StagePlan]:
        for replica in self.replicas:
            for stage in replica.stages:
                if stage.rank == rank:
                    return replica, stage
        raise KeyError(rank)

    def to_json(self) -> str:
        return json.dumps(_to_data(self), indent=1, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_json(text: str, source: str = "plan.json") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"not valid JSON: {exc}", file=source,
                                fix="re-run `plan` to write it again") from exc
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanFileError(f"schema_version {version}, this hetplan reads {SCHEMA_VERSION}",
                                file=source, field="schema_version", fix="re-plan with this version")
        try:
            return _build(Plan, data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFileError(f"malformed plan: {exc}", file=source, fix="re-run `plan`") from exc

    @staticmethod
    def load(path: str | Path) -> Plan:
        p = Path(path)
        if p.is_dir():
            p = p / "plan.json"
        if not p.is_file():
            raise PlanFileError("no plan here", file=str(p), fix="run `plan MODEL --cluster SPEC -o DIR` first")
        return Plan.from_json(p.read_text(), str(p))


def _to_data(value: Any) -> Any:
    """JSON data of a record: dataclasses as mappings (OPTIONAL fields only where not at their default),
    tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.metadata.get("omit_default") and item == _default_of(f):
                continue
            out[f.name] = _to_data(item)
        return out
    if isinstance(value, (tuple, list)):
        return [_to_data(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_data(v) for k, v in value.items()}
    return value


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _build(tp: Any, value: Any) -> Any:
    """Rebuild typed dataclasses from JSON data, guided by the type hints."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        kwargs = {f.name: _build(hints[f.name], value[f.name]) for f in dataclasses.fields(tp)
                  if f.name in value}
        return tp(**kwargs)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(non_none[0], value)
    if tp is float:
        return float(value)
    return value
